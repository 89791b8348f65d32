"""Where `gpuscope share` lives on a node, and what a tenant's container is given: one definition for
the Kubernetes objects (``gpuscope.kube``), the compose profile, the admission webhook and the docs.

On a node the controller (a DaemonSet, or the compose ``share`` service) keeps everything tenants
need in one host folder, ``NODE_DIR``: the join socket and lock (``LEDGER``'s ``.sock``/``.lock``) and
a copy of the preload library (``LIBRARY``), so that a tenant image needs nothing of gpuscope. A
tenant container mounts that folder read-only at the same path and gets the environment below.
"""

from __future__ import annotations

#: The host folder the controller owns, mounted at the same path into tenants.
NODE_DIR = "/run/gpuscope-share"
#: The ledger prefix inside it (the controller's --share.ledger, the tenants' GPUSCOPE_SHARE_LEDGER).
LEDGER = f"{NODE_DIR}/ledger"
#: The preload library, copied there by the controller at start.
LIBRARY = f"{NODE_DIR}/lib/libgpuscope-share.so"
#: The volume's name in a pod spec.
VOLUME = "gpuscope-share"

#: Pod annotations the webhook reads: the tenant to join as, and an optional memory cap for each of the
#: pod's processes (a process can lower its own cap below its tenant's, never raise it).
TENANT_ANNOTATION = "gpuscope.io/share-tenant"
MEMORY_ANNOTATION = "gpuscope.io/share-memory"
#: The label a namespace carries to have its pods sent to the webhook (the webhook's namespaceSelector).
NAMESPACE_LABEL = "gpuscope.io/share"
NAMESPACE_LABEL_VALUE = "enabled"

#: The webhook's HTTPS port and path.
WEBHOOK_PORT = 8443
WEBHOOK_PATH = "/mutate"
#: The policy ConfigMap's key (mounted as a file at POLICY_FILE in the controller).
POLICY_KEY = "policy.yaml"
POLICY_FILE = f"/etc/gpuscope-share/{POLICY_KEY}"


def tenant_environment(tenant: str, memory: str | None = None) -> dict[str, str]:
    """The environment a tenant container gets (besides LD_PRELOAD, which is merged with its own)."""
    env = {"GPUSCOPE_SHARE_TENANT": tenant, "GPUSCOPE_SHARE_LEDGER": LEDGER}
    if memory:
        env["GPUSCOPE_SHARE_MEMORY"] = memory
    return env
