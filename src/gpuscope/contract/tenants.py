"""What a tenant name may be: one rule for the server's ``--tenants`` and the load tests' tenants."""

from __future__ import annotations

import re

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: The rule, as error messages state it.
NAME_RULE = "1-64 of A-Z a-z 0-9 _ . -"


def valid_tenant_name(name: str) -> bool:
    return bool(_NAME.match(name))
