"""Small libraries the programs share: command-line flags (``flags``), JSON over ``http.server``
(``httpjson``), log lines that cannot be forged (``logsafe``), free TCP ports (``freeport``).

Above the contract, below everything else: they import nothing of gpuscope but each other.
"""
