"""Energy and cost per output token, per server and per tenant (recording rules only).

Inputs are normalised series, so every source that has them gets the records: GPU energy as watts
(``gpuscope:gpu_energy_joules:rate``, from NVML's total-energy counter in gpuscope exporter or
dcgm-exporter's ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` in mJ), generated tokens
(``gpuscope:generation_tokens:rate``, gpuscope serve or vLLM), and for tenants the share of the
server's GPU time each got (``gpuscope:tenant_gpu_seconds:share``, gpuscope serve only: vLLM has
no per-tenant GPU time, so its servers get per-server records and no tenant split).

How energy is attributed:

- **host**: servers and GPU exporters meet by ``host`` as the bottleneck rules join them
  (``promql.with_host``: a ``host`` label the scrape sets, else the host part of ``instance``).
  The host's GPU watts are the sum over its GPUs of the energy counter's rate.
- **server**: the host's GPU energy split between the servers on that host by their output tokens
  (one server per GPU host, the usual case, gets all of it). J/token = server watts / tokens per
  second: idle power within the window is charged to the tokens of the window, as the bill is.
- **tenant**: the server's watts split by the tenants' GPU-seconds shares, over each tenant's own
  tokens: a tenant of long prompts or big batches pays for the GPU time it used, not per token.
- **cost**: ``cost.gpu_hour`` (``gpuscope.contract.profiles``) × the GPUs attributed (the host's GPUs
  split as the energy is) / 3600 × 10⁶ / tokens per second: the price of a million output tokens. With
  the default price of 1 it reads in GPU-hours per million output tokens.

Every record is absent while its denominator is zero (no tokens: no cost per token).
"""

from __future__ import annotations

from gpuscope.alerting.rules import Group, Record
from gpuscope.contract import names
from gpuscope.contract.profiles import Profile
from gpuscope.util.promql import with_host

SERVER = "host, job, instance"
TENANT = "host, job, instance, tenant"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def groups(p: Profile) -> list[Group]:
    # A GPU-second's price × 10⁶: × GPUs ÷ tokens per second = the price of a million tokens.
    per_gpu_hour = p.cost.gpu_hour / 3600 * 1e6
    tokens = with_host(f"{names.GENERATION_TOKENS_RATE}{{@M}}")
    tenant_tokens = f"sum by ({TENANT}) (\n{_indent(tokens)}\n) > 0"
    tenant_share = with_host(f"{names.TENANT_GPU_SHARE}{{@M}}")
    records = [
        Record(names.HOST_GPU_POWER,
               f"sum by (host) (\n{_indent(with_host(f'{names.GPU_ENERGY_RATE}{{@M}}'))}\n)"),
        Record(names.HOST_GPUS, f"count by (host) (\n{_indent(with_host(f'{names.GPU_INFO}{{@M}}'))}\n)"),
        Record(names.SERVER_OUTPUT_TOKENS_RATE,
               f"sum by ({SERVER}) (\n{_indent(with_host(f'{names.GENERATION_TOKENS_RATE}{{@M}}'))}\n)"),
        Record(names.SERVER_OUTPUT_TOKENS_HOST_SHARE,
               f"{names.SERVER_OUTPUT_TOKENS_RATE}\n/ on (host) group_left ()\n"
               f"(sum by (host) ({names.SERVER_OUTPUT_TOKENS_RATE}) > 0)"),
        Record(names.SERVER_GPU_POWER,
               f"{names.SERVER_OUTPUT_TOKENS_HOST_SHARE}\n* on (host) group_left ()\n{names.HOST_GPU_POWER}"),
        Record(names.ENERGY_PER_OUTPUT_TOKEN,
               f"{names.SERVER_GPU_POWER}\n/\n({names.SERVER_OUTPUT_TOKENS_RATE} > 0)"),
        Record(names.COST_PER_MILLION_OUTPUT_TOKENS,
               f"{names.SERVER_OUTPUT_TOKENS_HOST_SHARE}\n* on (host) group_left ()\n{names.HOST_GPUS}\n"
               f"* {per_gpu_hour!r}\n/\n({names.SERVER_OUTPUT_TOKENS_RATE} > 0)"),
        Record(names.TENANT_GPU_POWER,
               f"(\n{_indent(tenant_share)}\n)\n* on ({SERVER}) group_left ()\n{names.SERVER_GPU_POWER}"),
        Record(names.TENANT_ENERGY_PER_OUTPUT_TOKEN,
               f"{names.TENANT_GPU_POWER}\n/ on ({TENANT})\n({tenant_tokens})"),
        Record(names.TENANT_COST_PER_MILLION_OUTPUT_TOKENS,
               f"(\n{_indent(tenant_share)}\n)\n* on ({SERVER}) group_left ()\n"
               f"({names.SERVER_OUTPUT_TOKENS_HOST_SHARE} * on (host) group_left () {names.HOST_GPUS})\n"
               f"* {per_gpu_hour!r}\n/ on ({TENANT})\n({tenant_tokens})"),
    ]
    return [Group("gpuscope-energy", tuple(records))]
