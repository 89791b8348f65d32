"""Operations: commands that run, start or write the other parts.

- ``procs``: child processes (start, wait until ready, stop);
- ``stack``: the compose stack from local binaries (``Stack``); ``fleet``: several hosts remote-writing
  to one VictoriaMetrics (``Fleet``); ``stack_command``: ``gpuscope stack``, which runs either;
- ``generate``: ``gpuscope generate``, every generated file from its one source.
"""
