"""dcgm-exporter's series as deployed, turned into one stable series per GPU (or MIG instance).

What dcgm-exporter writes (NVIDIA/dcgm-exporter, ``internal/pkg/collector/gpu_collector.go`` and
``internal/pkg/transformation/kubernetes.go``, 3.3 / 4.x) and what a scrape adds, and how each would
break a join if the normalised series kept it:

- **MIG**: every GPU instance is its own series with its parent's ``gpu`` and ``GPU_I_ID`` /
  ``GPU_I_PROFILE``. Kept apart by ``gpu`` alone they collide (many-to-many on ``gpu``); so each
  instance becomes ``gpu="<parent>/gi<GPU_I_ID>"``, the shape the bundle's own exporter gives MIG
  instances (``"0/gi1/ci0"``), and every alert, route and panel keyed on ``gpu`` is per instance.
- **Kubernetes**: the pod mapper adds the workload's ``pod``, ``namespace``, ``container``, which change
  when the workload's pod is replaced; the old pod's series stays inside every range window for that
  long. Scraped through a ServiceMonitor with ``honorLabels: false`` (the Helm chart's default) they
  arrive as ``exported_pod`` / ``exported_namespace`` / ``exported_container``, and ``pod`` /
  ``namespace`` / ``container`` are the *exporter's* pod. The normalised series drop all six; the
  workload's (whichever way they arrive) stay on ``gpuscope:gpu:info``, which alerts join for the
  labels an operator acts on.
- **XID**: since 3.3.6 (``err_code`` / ``err_msg`` attributes) each code is its own series whose value
  is still the code; before, one last-code gauge. Either way the *largest value* over the GPU's series
  is its last code, so one stable series per GPU carries it for both (``GPU_XID_CODE``).
"""

from __future__ import annotations

from gpuscope.alerting import workload
from gpuscope.contract import upstream as up
from gpuscope.util.promql import by, sel

#: MIG labels (folded into ``gpu``).
MIG = up.DCGM_MIG_LABELS
#: The XID field's per-code labels (3.3.6+).
XID_CODE = up.DCGM_XID_LABELS
#: The workload's labels under a ServiceMonitor with ``honorLabels: false``.
EXPORTED_KUBERNETES = workload.EXPORTED
#: Temporary labels: the MIG fold builds ``gpu`` from the first, the info series its parent from the second.
_FOLD, _PARENT = "gpuscope_gi", "gpuscope_parent"
#: What a normalised dcgm-exporter series aggregates away: its identity (on ``gpuscope:gpu:info``), MIG
#: (folded into ``gpu``), the XID code labels, and every Kubernetes label, the workload's and, with
#: ``honorLabels: false``, the exporter pod's own (stable, but the same names as the workload's).
DROP = (*(label for label in up.DCGM_LABELS if label != "gpu"), *MIG, *XID_CODE, *up.DCGM_KUBERNETES_LABELS,
        *EXPORTED_KUBERNETES, _FOLD)
#: Identity labels the info series renames to the canonical ones (``gpuscope_gpu_info``'s).
INFO_RENAMES = {"uuid": "UUID", "name": "modelName", "mig_profile": "GPU_I_PROFILE"}


def fold_mig(expr: str) -> str:
    """Each MIG instance its own ``gpu``: ``"0"`` stays ``"0"``, instance 1 on GPU 0 is ``"0/gi1"``."""
    marked = f'label_replace({expr}, "{_FOLD}", "/gi$1", "GPU_I_ID", "(.+)")'
    return f'label_join({marked}, "gpu", "", "gpu", "{_FOLD}")'


def normalised(expr: str, aggregation: str = "max") -> str:
    """One series per GPU or MIG instance and scrape target, whatever pods come and go."""
    return f"{aggregation} without ({by(DROP)}) (\n  {fold_mig(expr)}\n)"


def info(s: str, metric: str = "DCGM_FI_DEV_FB_USED") -> str:
    """``gpuscope:gpu:info``: value 1 per GPU or MIG instance, with uuid, name, mig_parent and mig_profile,
    and the workload's pod, namespace and container where the exporter maps one (``workload.per_gpu``)."""
    parent = f'label_join({sel(metric, s)}, "{_PARENT}", ";", "GPU_I_ID", "gpu")'
    expr = f'label_replace({parent}, "mig_parent", "$1", "{_PARENT}", "[^;]+;(.*)")'
    for canonical, own in INFO_RENAMES.items():
        expr = f'label_replace({expr}, "{canonical}", "$1", "{own}", "(.+)")'
    drop = (*(label for label in DROP if label not in ("gpu", *workload.DROP)), _PARENT)
    return workload.per_gpu(fold_mig(expr), s, drop)


def gpus(s: str, metric: str = "DCGM_FI_DEV_FB_USED") -> str:
    """GPUs (and MIG instances) per exporter target: one series per target whatever the scrape's mode
    (a time-sliced GPU that dcgm-exporter writes once per pod counts once); 0 while it reports none."""
    kube = by(up.DCGM_KUBERNETES_LABELS)
    return (f"count without (gpu) (\n{normalised(sel(metric, s))}\n)\n"
            f"or\n0 * group without ({kube}) (up{{{s}}})")


def xid_code(s: str, codes: tuple[int, ...]) -> str:
    """The last XID code per GPU, from either format. The per-code series' value is the code too
    (gpu_collector.go writes the field's value); for ``codes`` (the ones alerts page on) the code is
    taken from ``err_code`` regardless, so a build that writes another value there is read right."""
    xid = "DCGM_FI_DEV_XID_ERRORS"
    named = [f'{sel(xid, s, f"err_code={chr(34)}{c}{chr(34)}")} * 0 + {c}' for c in codes]
    parts = [sel(xid, s, 'err_code=""'), *named, sel(xid, s, 'err_code!=""')]
    return normalised("\n  or ".join(parts))

