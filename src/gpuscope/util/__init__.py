"""Small libraries the programs share: command-line flags (``flags``), each command's settings
declared once as a dataclass its parser is built from (``settings``), JSON over ``http.server``
(``httpjson``), log lines that cannot be forged (``logsafe``), free TCP ports (``freeport``).

Above the contract, below everything else: they import nothing of gpuscope but the contract (the
settings' ``Choice``) and each other.
"""
