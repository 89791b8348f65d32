"""`gpuscope share` on one GPU: two unmodified processes held to GPU-time shares by the preload library.

One call does everything (H200, about 7 minutes):

1. solo: a process alone, plain and under the library (controller running, shares not binding), in
   interleaved pairs: CPU per tiny launch, matmul throughput, a CUDA-graph replay loop (accounted?),
   and a checksum of the matmul output (bit-identical?);
2. two matmul loops at 70/30 (``--share.accounting events``), throughput per 5 s window against alone;
3. the same with ``--share.accounting nvml`` (the peers' token bucket on NVML utilization);
4. a Llama-shaped Hugging Face decode loop (random weights, high priority, share 0.3) alone (plain),
   its kernels' share of its time (the PyTorch profiler: what its probes should read), then beside a
   matmul hog (0.7), in both modes: p99 step latency against alone, tokens identical? (in
   ``--llm-rounds`` interleaved rounds, each variant against the loop alone of its own round)
   (``llm-events-over-share``: at a share of its kernel fraction, below what its probes read, so that
   a duty cycle holds it);
and the CPU of the controller and of each process's helper thread throughout. With ``--mps`` every
process of the run is a client of an MPS control daemon that the script starts (in a directory of its
own) and stops: the same measurements with the clients' kernels able to run concurrently.

    PYTHONPATH=src python benchmarks/share_bench.py --out share.json       # on the GPU host
    PYTHONPATH=src python benchmarks/share_bench.py --plot share.json share.png   # anywhere

The worker processes are this file too (``worker MODE``): plain PyTorch, no gpuscope import, loaded
with LD_PRELOAD exactly as a tenant would be.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchlib import write_json

LEDGER = "/dev/shm/gpuscope-share-bench"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def helper_wakeups_per_s(first: tuple[float, list[str]], second: tuple[float, list[str]]
                         ) -> dict[str, dict[str, float]]:
    """Each tenant's helper wake-ups a second by reason between two scrapes of the controller's
    ``gpuscope_share_*`` series ((time, lines) each), its processes summed: what each helper slept on."""
    from prometheus_client.parser import text_string_to_metric_families

    from gpuscope.contract import catalogue as cat

    def totals(lines: list[str]) -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        text = "\n".join(ln for ln in lines if ln.startswith(cat.SHARE_HELPER_WAKEUPS.name + "{")) + "\n"
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.labels["tenant"], sample.labels["reason"])
                out[key] = out.get(key, 0.0) + sample.value
        return out

    (t0, a), (t1, b) = first, second
    before, after = totals(a), totals(b)
    rates: dict[str, dict[str, float]] = {}
    for (tenant, reason), value in after.items():
        per_s = (value - before.get((tenant, reason), 0.0)) / max(t1 - t0, 1e-9)
        rates.setdefault(tenant, {})[reason] = round(per_s, 1)
    return rates


# --------------------------------------------------------------------------------------------------
# Workers (run as separate processes)

def _stats() -> dict | None:
    import ctypes

    own = ctypes.CDLL(None)
    if not hasattr(own, "gpuscope_share_stats"):
        return None
    out = (ctypes.c_uint64 * 8)()
    own.gpuscope_share_stats(out)
    keys = ["launches", "graph_launches", "hook_errors", "throttled_ns", "gpu_ns", "windows", "failed_open",
            "joined"]
    return dict(zip(keys, list(out), strict=True))


def _helper_threads() -> list[str]:
    """/proc folders of this process's gpuscope-share helper threads."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "gpuscope-share":
                    out.append(f"/proc/self/task/{tid}")
        except OSError:
            continue
    return out


def _helper_cpu_s() -> float:
    """CPU seconds of this process's gpuscope-share helper thread (0 without one): from schedstat, in
    nanoseconds (the stat file's clock ticks are 10 ms, too coarse for a few seconds' run)."""
    total = 0.0
    for task in _helper_threads():
        try:
            with open(f"{task}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            with open(f"{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _helper_wakeups() -> int:
    """Voluntary context switches of the helper thread: how often it slept and woke."""
    total = 0
    for task in _helper_threads():
        with open(f"{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return total


def worker(mode: str, seconds: float, start_at: float) -> dict:
    import torch

    torch.manual_seed(0)
    dev = "cuda"
    result: dict = {"mode": mode}
    if mode in ("solo", "hog"):
        x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        y = x @ x
        torch.cuda.synchronize()
    if mode == "solo":
        # CPU per tiny launch (launch-bound): 3 reps of 20000, best rep
        t = torch.zeros(16, device=dev)
        per = []
        for _ in range(3):
            c0 = time.process_time()
            for _ in range(20000):
                t.add_(1)
            per.append((time.process_time() - c0) / 20000 * 1e6)
            torch.cuda.synchronize()
        result["launch_cpu_us"] = min(per)
        # tiny-kernel throughput (where hook cost would show)
        w0 = time.perf_counter()
        for _ in range(20000):
            t.add_(1)
        torch.cuda.synchronize()
        result["tiny_launches_per_s"] = 20000 / (time.perf_counter() - w0)
        # a CUDA-graph replay loop
        g = torch.cuda.CUDAGraph()
        small = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(4):
                z = small @ small
        before = _stats()
        for _ in range(200):
            g.replay()
        torch.cuda.synchronize()
        time.sleep(0.05)  # let the helper post the last windows (read, not asserted, here)
        after = _stats()
        result["graph"] = {"replays": 200, "before": before, "after": after}
        result["graph_checksum"] = hashlib.sha256(z.float().cpu().numpy().tobytes()).hexdigest()[:16]
    if mode in ("solo", "hog"):
        while time.time() < start_at:
            time.sleep(0.001)
        helper0 = (_helper_cpu_s(), _helper_wakeups(), time.time())
        stamps = []
        end = time.time() + seconds
        while time.time() < end:
            for _ in range(10):
                y = x @ x
            torch.cuda.synchronize()
            stamps.append(time.time())
        result["stamps"] = stamps
        result["checksum"] = hashlib.sha256(y.float().cpu().numpy().tobytes()).hexdigest()[:16]
    if mode in ("llm", "llm-kernels"):
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                          num_attention_heads=16,
                          num_key_value_heads=16, vocab_size=32000, max_position_embeddings=1024)
        model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).eval()
        prompt = torch.randint(0, 32000, (8, 64), device=dev, generator=torch.Generator(dev).manual_seed(1))

        def request() -> tuple[list[tuple[float, float]], list[int]]:
            steps, tokens = [], []
            with torch.no_grad():
                out = model(input_ids=prompt, use_cache=True)
                pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                for _ in range(32):
                    s0 = time.perf_counter()
                    out = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
                    pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                    torch.cuda.synchronize()
                    steps.append((time.time(), time.perf_counter() - s0))
                    tokens.append(int(nxt[0, 0]))
            return steps, tokens

        request()  # warm-up
        if mode == "llm-kernels":
            result["kernels"] = _kernel_time(request)
            return result
        while time.time() < start_at:
            time.sleep(0.001)
        helper0 = (_helper_cpu_s(), _helper_wakeups(), time.time())
        steps, first_tokens = [], None
        end = time.time() + seconds
        while time.time() < end:
            s, tok = request()
            steps += s
            first_tokens = first_tokens or tok
        result["steps"] = steps
        result["tokens"] = first_tokens
    result["stats"] = _stats()
    result["helper_cpu_s"] = _helper_cpu_s()
    if mode in ("solo", "hog", "llm"):  # the helper over the run alone, not the warm-up
        ran = time.time() - helper0[2]
        result["helper_run"] = {"cpu_pct": 100 * (_helper_cpu_s() - helper0[0]) / ran,
                                "wakeups_per_s": (_helper_wakeups() - helper0[1]) / ran,
                                "threads": len(_helper_threads())}  # threads it starts share its name
    return result


def _kernel_time(request) -> dict:
    """What the decode loop's kernels take on the GPU (CUPTI, through the PyTorch profiler) against
    its wall time per request unprofiled: the GPU-time fraction a probe should find."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    w0 = time.perf_counter()
    for _ in range(5):
        request()
    wall_ms = (time.perf_counter() - w0) / 5 * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            request()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.time_range.elapsed_us() for e in kernels)
    if not kernels:  # older profilers attach device time to the operators only
        kernel_us = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    kernel_ms = kernel_us / 1e3 / 3
    return {"wall_ms_per_request": wall_ms, "kernel_ms_per_request": kernel_ms,
            "kernels_per_request": len(kernels) / 3, "kernel_fraction": kernel_ms / wall_ms}


# --------------------------------------------------------------------------------------------------
# Orchestration

def _lib() -> str:
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from gpuscope.share.preload import library_path

    lib = library_path()
    if lib is None:
        raise SystemExit("build the preload library first: python setup.py build_ext --inplace")
    return lib


def spawn(mode: str, seconds: float, start_at: float, tenant: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if tenant:
        env.update(LD_PRELOAD=_lib(), GPUSCOPE_SHARE_TENANT=tenant, GPUSCOPE_SHARE_LEDGER=LEDGER)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", mode, str(seconds),
                             str(start_at)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def collect(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"worker failed: {err[-2000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    res["stderr"] = err[-400:]
    return res


def process_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``, to the nanosecond (its CPU-time clock; /proc's ticks are 10 ms,
    too coarse for a controller that uses a few ms a second)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clock = ctypes.c_int()
    ts = (ctypes.c_long * 2)()
    if libc.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0 and libc.clock_gettime(clock, ts) == 0:
        return ts[0] + ts[1] / 1e9
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Controller:
    """`gpuscope share` as a subprocess, with its CPU time and a /metrics scrape at the end (started as
    ``launcher share ...``, with ``env`` added to this process's environment)."""

    def __init__(self, shares: str, accounting: str, port: int, *extra: str, ledger: str = LEDGER,
                 launcher: tuple[str, ...] = (sys.executable, "-m", "gpuscope.cli"),
                 env: dict[str, str] | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), **(env or {}))
        self.port = port
        tenants = ["--share", shares] if shares else []  # none: a --share.policy-file in ``extra``
        self.p = subprocess.Popen([*launcher, "share", *tenants,
                                   "--share.accounting", accounting, "--share.ledger", ledger,
                                   "--web.listen-address", f"127.0.0.1:{port}", *extra], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 30
        while not os.path.exists(ledger + ".sock"):  # tenants join through it
            if self.p.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"controller did not start: {self.p.communicate()[1][-1000:]}")
            time.sleep(0.05)
        self.mark()

    def mark(self) -> None:
        """Count the controller's CPU and wake-ups from now: call it when the tenants start, so that the
        seconds before (the tenants importing torch, the controller idle) do not dilute them."""
        self.t0, self.cpu0, self.switches0 = time.time(), self.cpu(), self.switches()

    def switches(self) -> int:
        """Voluntary context switches of all the controller's threads: its wake-ups."""
        total = 0
        for tid in os.listdir(f"/proc/{self.p.pid}/task"):
            with open(f"/proc/{self.p.pid}/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        return total

    def cpu(self) -> float:
        return process_cpu_s(self.p.pid)

    def scrape(self) -> list[str]:
        """Its ``gpuscope_share_*`` series now (one line saying why, when the scrape fails)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                return [ln for ln in r.read().decode().splitlines() if ln.startswith("gpuscope_share_")]
        except OSError as exc:
            return [f"scrape failed: {exc}"]

    def stop(self) -> dict:
        """Stop it; its CPU and wake-ups since ``mark`` (call it as the tenants finish)."""
        cpu = self.cpu() - self.cpu0
        wall = time.time() - self.t0
        wakeups = self.switches() - self.switches0
        share_lines = self.scrape()
        self.p.terminate()
        _, err = self.p.communicate(timeout=30)
        return {"cpu_s": cpu, "wall_s": wall, "cpu_core_pct": 100 * cpu / wall,
                "wakeups_per_s": wakeups / wall, "cpu_us_per_wakeup": 1e6 * cpu / max(1, wakeups),
                "metrics": share_lines,
                "stderr": err[-500:]}


def sleep_until(t: float) -> None:
    while time.time() < t:
        time.sleep(min(0.05, max(0.0, t - time.time())))


def rate(stamps: list[float], lo: float, hi: float) -> float:
    return sum(1 for s in stamps if lo <= s < hi) / (hi - lo)


def pair_run(shares: str, accounting: str, seconds: float, alone: float, port: int, *extra: str) -> dict:
    from gpuscope.share.settings import DEFAULT_SLICE_S  # recorded: the default turn changed once

    ctl = Controller(shares, accounting, port, *extra)
    start = time.time() + 12  # both processes past torch's start-up
    pa, pb = spawn("hog", seconds, start, "a"), spawn("hog", seconds, start, "b")
    sleep_until(start)
    ctl.mark()
    nvml_series = []  # what the nvml accounting reads, polled as the controller polls it
    if accounting == "nvml":
        from gpuscope.share.nvml_source import nvml_utilization

        held = nvml_utilization(0)
        while time.time() < start + seconds:
            nvml_series.append([round(time.time() - start, 2), {str(k): v for k, v in held().items()}])
            time.sleep(0.1)
    while time.time() < start + seconds / 2:
        time.sleep(0.2)
    nvml_seen = nvml_process_samples()
    ra, rb = collect(pa), collect(pb)
    c = ctl.stop()
    windows = []
    t = start
    while t + 5 <= start + seconds + 1e-6:
        windows.append({"t": t - start, "a": rate(ra["stamps"], t, t + 5) / alone,
                        "b": rate(rb["stamps"], t, t + 5) / alone})
        t += 5
    whole_a = rate(ra["stamps"], start + 5, start + seconds) / alone
    whole_b = rate(rb["stamps"], start + 5, start + seconds) / alone
    after_first = windows[1:]
    worst = max(max(abs(w["a"] - 0.7), abs(w["b"] - 0.3)) for w in after_first)
    gpu = {k: r["stats"]["gpu_ns"] / 1e9 for k, r in (("a", ra), ("b", rb))}
    return {"accounting": accounting, "flags": list(extra), "default_slice_s": DEFAULT_SLICE_S,
            "seconds": seconds, "windows": windows,
            "a": whole_a, "b": whole_b,
            "worst_window_error_points": 100 * worst, "within_2_points": worst <= 0.02,
            "gpu_seconds": gpu, "throttled_s": {"a": ra["stats"]["throttled_ns"] / 1e9,
                                                  "b": rb["stats"]["throttled_ns"] / 1e9},
            "helper_cpu_s": {"a": ra["helper_cpu_s"], "b": rb["helper_cpu_s"]},
            "helper_run": {"a": ra.get("helper_run"), "b": rb.get("helper_run")},
            "hook_errors": ra["stats"]["hook_errors"] + rb["stats"]["hook_errors"],
            "checksums_equal": ra["checksum"] == rb["checksum"], "controller": c,
            "pids": {"a": pa.pid, "b": pb.pid}, "nvml_process_samples_mid_run": nvml_seen,
            "nvml_series": nvml_series}


def nvml_process_samples() -> object:
    """What NVML's per-process utilization says mid-run (what the nvml accounting reads)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return [[s.pid, s.smUtil, s.timeStamp] for s in pynvml.nvmlDeviceGetProcessUtilization(h, 0)][-8:]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


POLLED = ("gpuscope_share_state_seconds_total", "gpuscope_share_busy_launches_total",
          "gpuscope_share_duty_ratio", "gpuscope_share_busy_ratio",
          "gpuscope_share_launches_total", "gpuscope_share_charged_seconds_total",
          "gpuscope_share_throttled_seconds_total")


class MetricsPoller:
    """Scrapes the controller's share lines every ``every_s`` in a thread: the gate states over time."""

    def __init__(self, port: int, t0: float, every_s: float = 2.0) -> None:
        import threading

        self.series: list[list] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(port, t0, every_s), daemon=True)
        self._thread.start()

    def _run(self, port: int, t0: float, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    lines = [ln for ln in r.read().decode().splitlines()
                             if ln.startswith(POLLED)]
                self.series.append([round(time.time() - t0, 2), lines])
            except OSError:
                continue

    def stop(self) -> list[list]:
        self._stop.set()
        self._thread.join()
        return self.series


def llm_run(accounting: str | None, seconds: float, port: int, alone: float,
            shares: str = "llm=0.3:1,hog=0.7", *extra: str, hog: bool = True) -> dict:
    """The decode loop, beside a matmul hog (``hog``): under the library with a controller in mode
    ``accounting``, or with neither (``accounting`` None: plain processes, the GPU's own time-slicing)."""
    ctl = Controller(shares, accounting, port, *extra) if accounting else None
    start = time.time() + 15
    poller = MetricsPoller(port, start) if ctl else None
    pl = spawn("llm", seconds, start, "llm" if accounting else None)
    ph = spawn("hog", seconds, start, "hog" if accounting else None) if hog else None
    sleep_until(start)
    if ctl:
        ctl.mark()
    rl = collect(pl)
    rh = collect(ph) if ph else None
    series = poller.stop() if poller else []
    c = ctl.stop() if ctl else None
    lat = [s[1] for s in rl["steps"]]
    return {"accounting": accounting, "shares": shares, "hog": hog, "steps": len(lat),
            "p50_ms": 1e3 * pct(lat, 0.5), "p90_ms": 1e3 * pct(lat, 0.9),
            "p99_ms": 1e3 * pct(lat, 0.99), "tokens": rl["tokens"], "llm_stats": rl["stats"],
            "step_series": [[round(t - start, 3), round(1e3 * d, 2)] for t, d in rl["steps"]],
            "metrics_series": series,
            "hog_its_per_s": (len(rh["stamps"]) / seconds) if rh else None,
            "hog_vs_alone": (len(rh["stamps"]) / seconds / alone) if rh else None,
            "helper_cpu_s": rl["helper_cpu_s"] + (rh["helper_cpu_s"] if rh else 0.0),
            "helper_run": {"llm": rl.get("helper_run"), "hog": rh.get("helper_run") if rh else None},
            "controller": c}


@contextlib.contextmanager
def mps_daemon(enabled: bool):
    """An MPS control daemon for the processes this script starts, yielding what was seen of it: the
    pipe and log folders are private, so no other MPS user of the machine is touched."""
    if not enabled:
        yield None
        return
    folder = tempfile.mkdtemp(prefix="gpuscope-share-mps-")
    os.environ["CUDA_MPS_PIPE_DIRECTORY"] = folder
    os.environ["CUDA_MPS_LOG_DIRECTORY"] = folder
    subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)
    seen: dict = {"pipe_directory": folder}
    try:
        yield seen
    finally:
        seen["server_running_at_end"] = subprocess.run(
            ["pgrep", "-f", "nvidia-cuda-mps-server"], capture_output=True).returncode == 0
        subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", check=False)
        with contextlib.suppress(OSError), open(os.path.join(folder, "control.log")) as f:
            seen["control_log_tail"] = f.read()[-2000:]


def main_bench(args: argparse.Namespace) -> dict:
    _lib()
    with mps_daemon(args.mps) as mps:
        out = _bench(args, mps)
    if mps is not None:  # out["mps"] is this dict: saved again with what was seen as the daemon stopped
        write_json(args.out, out, indent=1)
    return out


def _bench(args: argparse.Namespace, mps: dict | None) -> dict:

    def save() -> None:  # after every phase: a later failure keeps what was measured
        write_json(args.out, out, indent=1)

    out: dict = {"date": time.strftime("%Y-%m-%d"), "gpu": subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True,
        text=True).stdout.strip(), "mps": mps}
    phases = set(args.phases.split(","))
    # 1. solo, interleaved: plain, library, plain, library
    solo = []
    for rnd in range(args.rounds if "solo" in phases else 0):
        for under in (False, True):
            ctl = Controller("a=0.7,b=0.3", "events", args.port) if under else None
            r = collect(spawn("solo", args.solo_seconds, time.time(), "a" if under else None))
            c = ctl.stop() if ctl else None
            its = len(r["stamps"]) / args.solo_seconds
            solo.append({"round": rnd, "library": under, "matmul_its_per_s": its,
                         "launch_cpu_us": r["launch_cpu_us"], "tiny_launches_per_s": r["tiny_launches_per_s"],
                         "checksum": r["checksum"], "graph_checksum": r["graph_checksum"],
                         "graph": r["graph"],
                         "stats": r["stats"], "helper_cpu_s": r["helper_cpu_s"], "controller": c})
            print(f"solo round {rnd} library={under}: {its:.1f} it/s, "
                  f"{r['launch_cpu_us']:.2f} µs CPU/launch, "
                  f"{r['tiny_launches_per_s']:.0f} tiny launches/s", flush=True)
    out["solo"] = solo
    if not solo:  # a partial run: the alone rate from a pass of its own
        r = collect(spawn("hog", 6.0, time.time() + 1, None))
        alone = rate(r["stamps"], r["stamps"][0], r["stamps"][-1])
        out["alone_its_per_s"] = alone
        print(f"alone: {alone:.1f} it/s", flush=True)
    if solo:
        return _rest(args, out, solo, phases, save)
    return _pairs_and_llm(args, out, alone, phases, save)


def _rest(args: argparse.Namespace, out: dict, solo: list, phases: set[str], save) -> dict:
    plain = [s for s in solo if not s["library"]]
    lib = [s for s in solo if s["library"]]
    alone = statistics.median(s["matmul_its_per_s"] for s in plain)
    g = lib[-1]["graph"]
    out["summary_solo"] = {
        "alone_its_per_s": alone,
        "throughput_loss_pct": 100 * (1 - statistics.median(s["matmul_its_per_s"] for s in lib) / alone),
        "tiny_throughput_loss_pct": 100 * (1 - statistics.median(s["tiny_launches_per_s"] for s in lib)
                                           / statistics.median(s["tiny_launches_per_s"] for s in plain)),
        "launch_cpu_us_added": statistics.median(s["launch_cpu_us"] for s in lib)
        - statistics.median(s["launch_cpu_us"] for s in plain),
        "bit_identical": (len({s["checksum"] for s in solo}) == 1
                          and len({s["graph_checksum"] for s in solo}) == 1),
        "graph_replays_counted": g["after"]["graph_launches"] - g["before"]["graph_launches"],
        "graph_gpu_ms_accounted": (g["after"]["gpu_ns"] - g["before"]["gpu_ns"]) / 1e6,
    }
    print(json.dumps(out["summary_solo"]), flush=True)
    save()
    return _pairs_and_llm(args, out, alone, phases, save)


def _pairs_and_llm(args: argparse.Namespace, out: dict, alone: float, phases: set[str], save) -> dict:
    # 2./3. two matmul loops at 70/30 (and a shorter run at 50 ms slices: the controller's CPU)
    out["pair"] = {}
    pairs = {"events": ("events", args.pair_seconds), "nvml": ("nvml", args.pair_seconds),
             "events-slice-50ms": ("events", args.pair_seconds, "--share.slice", "50ms"),
             "events-slice-20ms": ("events", args.pair_seconds, "--share.slice", "20ms"),
             "events-slice-30ms": ("events", args.pair_seconds, "--share.slice", "30ms"),
             "events-drain": ("events", args.pair_seconds, "--share.handover", "drain"),
             "events-overlap": ("events", args.pair_seconds, "--share.handover", "overlap"),
             "events-window-1ms": ("events", args.pair_seconds, "--share.window", "1ms"),
             "events-turns-python": ("events", args.pair_seconds, "--share.turns", "python"),
             "events-queue-1": ("events", args.pair_seconds, "--share.queued-windows", "1"),
             "events-slice-30ms-queue-1": ("events", args.pair_seconds, "--share.slice", "30ms",
                                           "--share.queued-windows", "1")}
    for key in [k for k in pairs if f"pair-{k}" in phases]:
        accounting, seconds, *extra = pairs[key]
        r = pair_run("a=0.7,b=0.3", accounting, seconds, alone, args.port, *extra)
        out["pair"][key] = r
        helpers = ", ".join(f"{h['cpu_pct']:.2f}%" for h in r["helper_run"].values() if h)
        print(f"pair {key}: a {100 * r['a']:.1f}% b {100 * r['b']:.1f}% of alone, worst 5 s window "
              f"off by {r['worst_window_error_points']:.1f} points; controller "
              f"{r['controller']['cpu_core_pct']:.2f}% of a core, "
              f"{r['controller']['wakeups_per_s']:.0f} wake-ups/s; helpers {helpers}", flush=True)
        save()
    # 4. LLM beside a hog
    # llm-raw: both plain (the GPU's own time-slicing, no library); llm-alone-lib: the decode loop
    # alone under the library (shares not binding)
    runs = {"raw": (None, "llm=0.3:1,hog=0.7", True), "events": ("events", "llm=0.3:1,hog=0.7", True),
            "nvml": ("nvml", "llm=0.3:1,hog=0.7", True),
            "events-llm-share-0.7": ("events", "llm=0.7:1,hog=0.3", True),
            "alone-lib": ("events", "llm=0.3:1,hog=0.7", False),
            # a share the decode loop never exceeds: always beside the hog, never held
            "events-llm-share-0.9": ("events", "llm=0.9:1,hog=0.1", True),
            "events-overlap": ("events", "llm=0.3:1,hog=0.7", True, "--share.handover", "overlap"),
            # a share below what the decode loop needs (its profiled kernel fraction, which its probes
            # read about a fifth higher): held to it by a duty cycle, beside the hog
            "events-over-share": ("events", None, True),
            "events-probe-2s": ("events", "llm=0.3:1,hog=0.7", True, "--share.probe-every", "2s")}
    chosen = [k for k in runs if f"llm-{k}" in phases]
    if not chosen:
        return out
    k = None
    out["llm"] = {}
    try:
        k = out["llm"]["kernels"] = collect(spawn("llm-kernels", 0, time.time(), None))["kernels"]
        print(f"llm kernels alone: {k['kernel_ms_per_request']:.2f} ms of {k['kernels_per_request']:.0f} "
              f"kernels per {k['wall_ms_per_request']:.1f} ms request: GPU-time fraction "
              f"{k['kernel_fraction']:.3f}", flush=True)
    except RuntimeError as e:  # the profiler is a reference, not the measurement: go on without it
        print(f"llm kernels alone: not measured ({str(e)[-300:]})", flush=True)
    # The host's speed drifts between runs and within one (docs/share.md, "What it costs and what it
    # achieves"), so each variant is compared with the loop alone in the same round, and the rounds
    # interleave.
    out["llm"]["rounds"] = []
    for rnd in range(args.llm_rounds):
        alone_r = llm_run(None, args.llm_seconds, args.port, alone, hog=False)
        this = {"alone": alone_r}
        out["llm"]["rounds"].append(this)
        if rnd == 0:
            out["llm"]["alone"] = alone_r
        print(f"round {rnd} llm alone: p50 {alone_r['p50_ms']:.1f} p99 {alone_r['p99_ms']:.1f} ms",
              flush=True)
        for key in chosen:
            r = this[key] = llm_variant(args, runs[key], k, alone, alone_r)
            if r is None:
                continue
            if rnd == 0:
                out["llm"][key] = r
            print(f"round {rnd} llm {key}: {llm_line(r)}", flush=True)
            save()
    out["llm"]["summary"] = {
        key: {"p99_vs_alone_per_round": ratios, "p99_vs_alone_median": statistics.median(ratios)}
        for key in chosen
        if (ratios := [rd[key]["p99_vs_alone"] for rd in out["llm"]["rounds"] if rd.get(key)])}
    print(json.dumps(out["llm"]["summary"]), flush=True)
    save()
    return out


def llm_variant(args: argparse.Namespace, spec: tuple, kernels: dict | None, alone: float,
                alone_r: dict) -> dict | None:
    """One run of a decode-loop variant, compared with the loop alone (``alone_r``) of its round."""
    accounting, shares, hog, *extra = spec
    if shares is None:  # at a share of its profiled kernel fraction
        if kernels is None:
            return None
        llm_share = max(0.02, round(kernels["kernel_fraction"], 3))
        shares = f"llm={llm_share}:1,hog={round(1 - llm_share, 3)}"
    r = llm_run(accounting, args.llm_seconds, args.port, alone, shares, *extra, hog=hog)
    r["p99_vs_alone"] = r["p99_ms"] / alone_r["p99_ms"]
    r["tokens_identical"] = r["tokens"] == alone_r["tokens"]
    return r


def llm_line(r: dict) -> str:
    hog_text = "no hog"
    if r["hog"]:
        hog_text = f"hog {r['hog_its_per_s']:.1f} it/s ({100 * r['hog_vs_alone']:.0f}% of alone)"
    ctl_text = "plain"
    if r["controller"]:
        helpers = ", ".join(f"{h['cpu_pct']:.2f}%" for h in r["helper_run"].values() if h)
        ctl_text = f"controller {r['controller']['cpu_core_pct']:.2f}% of a core, helpers {helpers}"
    held = (r["llm_stats"] or {}).get("throttled_ns", 0) / 1e9
    busy = [ln.split(" ")[1] for ln in (r["controller"] or {}).get("metrics", [])
            if "busy_ratio{" in ln or "duty_ratio{" in ln]
    return (f"p50 {r['p50_ms']:.1f} p99 {r['p99_ms']:.1f} ms ({r['p99_vs_alone']:.2f}x alone), {hog_text}; "
            f"{ctl_text}; held {held:.2f} s; shares {r['shares']}, busy and duty {busy}")


def plot(sources: list[str], dst: str) -> None:
    """One panel per pair run found in ``sources`` (each a result of this script)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for src in sources:
        with open(src) as f:
            data = json.load(f)
        under = ", under MPS" if data.get("mps") else ""
        for variant, r in data.get("pair", {}).items():
            turn = r.get("default_slice_s")
            defaults = f"defaults: {1e3 * turn:g} ms turns" if turn else "the defaults of its day"
            flags = " ".join(r.get("flags", [])) or defaults
            panels.append((f"{os.path.basename(src)}: {variant} ({flags}{under})", r))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), sharey=True, squeeze=False)
    for ax, (title, r) in zip(axes[0], panels, strict=True):
        ts = [w["t"] + 2.5 for w in r["windows"]]
        for key, target, color in (("a", 0.7, "tab:blue"), ("b", 0.3, "tab:orange")):
            ax.plot(ts, [100 * w[key] for w in r["windows"]], "o-", color=color, label=f"tenant {key}")
            ax.axhspan(100 * target - 2, 100 * target + 2, color=color, alpha=0.15)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("seconds (5 s windows)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("throughput, % of alone (bands: share ±2)")
    axes[0][0].legend()
    fig.suptitle("Two matmul loops at 70/30 on one H200 under gpuscope share")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        print(json.dumps(worker(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="JSON results file")
    p.add_argument("--plot", nargs="+", metavar="FILE",
                   help="JSON result files then the PNG to draw: each tenant's share over time")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--solo-seconds", type=float, default=4.0)
    p.add_argument("--pair-seconds", type=float, default=60.0)
    p.add_argument("--llm-seconds", type=float, default=20.0)
    p.add_argument("--llm-rounds", type=int, default=1,
                   help="rounds of the decode loop alone then each variant (interleaved, compared per round)")
    p.add_argument("--port", type=int, default=9402)
    p.add_argument("--mps", action="store_true",
                   help="run every process as a client of an MPS daemon started for the run")
    p.add_argument("--phases",
                   default="solo,pair-events,pair-nvml,pair-events-slice-50ms,llm-events,llm-nvml",
                   help="which parts to run (comma-separated)")
    args = p.parse_args()
    if args.plot:
        if len(args.plot) < 2:
            p.error("--plot needs at least one JSON file and the PNG")
        plot(args.plot[:-1], args.plot[-1])
        return
    if not args.out:
        p.error("--out or --plot is needed")
    main_bench(args)


if __name__ == "__main__":
    main()
