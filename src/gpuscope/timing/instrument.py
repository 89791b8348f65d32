"""``timer.instrument(model)``: per-module GPU time for a ``torch.nn.Module``.

Sampling is decided once per forward pass, by a wrapper on the model's own
``forward``. Only a sampled pass puts the per-module wrappers in place (as
instance attributes, set in ``module.__dict__`` directly) and takes them out
after, so an unsampled pass costs one Python call, not one per module.
Per-module wrappers replace ``forward`` rather than hook it: even empty forward
hooks cost main-thread CPU on every forward (docs/design.md, "Inside a real
forward pass"), because a module with hooks leaves torch's fast call path.

The wrapper also measures what timing costs where it matters, inside the
program: the CPU time of sampled passes against unsampled ones (an online
paired comparison), which the overhead budget then uses.

Two modes:

* ``exact`` — each module's region spans exactly its ``forward`` (two records).
* ``partition`` — regions share boundaries (N+1 records for N modules): each
  module's region runs from its start to the next instrumented module's start
  (or the end of the model's forward), so glue between modules (residual adds,
  norms) is charged to the module before it. Nested matches are dropped.

``gpuscope_regions_entered_total`` for these ops is counted on sampled passes
and scaled by passes / sampled passes (exact for a model whose modules run the
same number of times every pass).

Compiled models (``torch.compile(model)``, ``model.compile()``, in either order with ``instrument``)
are timed by ``compiled.py``: sampling outside the compiled call, region boundaries as ops inside the
graph. An eagerly instrumented model switches to that scheme the first time its compiled form runs.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuscope.timing import compiled as compiled_mod
from gpuscope.timing import hot
from gpuscope.timing.core import OpState, TimerCore
from gpuscope.timing.sequence import Sequence as RegionSequence
from gpuscope.timing.sequence import new_sequence

if TYPE_CHECKING:
    from gpuscope.timing.timer import Timer

#: Module names timed when ``include`` is not given: the usual per-block breakdown.
DEFAULT_NAMES = frozenset({
    "attn", "attention", "self_attn", "self_attention", "mlp", "ffn", "feed_forward", "embed",
    "embedding", "embeddings", "wte", "tok_embeddings", "token_embedding", "lm_head", "head",
})

#: Weight of the newest pass in the running means of pass CPU time.
COST_SMOOTHING = 0.05
#: Measure every Nth unsampled pass (each measurement is two clock reads).
UNSAMPLED_MEASURE_EVERY = 8
#: Measurements of each kind needed before the in-program cost estimate is trusted.
MIN_COST_MEASUREMENTS = 8


def _matcher(include: Any) -> Callable[[str, Any], bool]:
    if include is None:
        import torch

        return lambda path, module: path.rsplit(".", 1)[-1] in DEFAULT_NAMES or isinstance(
            module, torch.nn.Embedding | torch.nn.MultiheadAttention)
    if callable(include):
        return include
    if isinstance(include, str):
        include = (include,)
    patterns = tuple(include)

    def match(path: str, module: Any) -> bool:
        last = path.rsplit(".", 1)[-1]
        return any(path == p or last == p or path.endswith("." + p) or fnmatch.fnmatchcase(path, p)
                   for p in patterns)

    return match


class PassCost:
    """Running means of the caller's CPU time per sampled and per unsampled pass, and of what the
    unsampled passes right after a run of sampled ones cost over the unsampled mean (switching a
    compiled model back to its untimed graph), per sampled pass of the run."""

    __slots__ = (
        "_after_pending_ns",
        "after_ns",
        "gaps",
        "n_after",
        "n_sampled",
        "n_unsampled",
        "sampled_ns",
        "unsampled_ns",
    )

    def __init__(self) -> None:
        self.sampled_ns = self.unsampled_ns = self.after_ns = self._after_pending_ns = 0.0
        self.n_sampled = self.n_unsampled = self.n_after = 0
        self.gaps = 0  # measurements dropped as no part of a pass (``step_cost``: the program idle)

    def add(self, sampled: bool, ns: int) -> None:
        if sampled:
            self.n_sampled += 1
            self.sampled_ns = ns if self.n_sampled == 1 else (
                self.sampled_ns + COST_SMOOTHING * (ns - self.sampled_ns))
        else:
            self.n_unsampled += 1
            self.unsampled_ns = ns if self.n_unsampled == 1 else (
                self.unsampled_ns + COST_SMOOTHING * (ns - self.unsampled_ns))

    def begin_after(self) -> None:
        """A measured run is over: the unsampled passes after it are measured from here (what was
        gathered of an earlier run's, if a new run cut it short, is dropped)."""
        self._after_pending_ns = 0.0

    def add_after(self, ns: int, closes_run_of: int) -> None:
        """One of the unsampled passes right after a measured run of sampled ones; ``closes_run_of``:
        on the last of them, the run's length (0 before), which its passes' excess is shared by."""
        self._after_pending_ns += ns - self.unsampled_ns
        if not closes_run_of:
            return
        excess, self._after_pending_ns = self._after_pending_ns / closes_run_of, 0.0
        if not self.n_unsampled:  # no unsampled mean yet to measure the excess against
            return
        self.n_after += 1
        self.after_ns = (excess if self.n_after == 1
                         else self.after_ns + COST_SMOOTHING * (excess - self.after_ns))

    def per_sampled_pass_s(self) -> float | None:
        """Extra CPU seconds a sampled pass costs (its own and the switch back after its run), once
        the sampled and unsampled means are trustworthy."""
        if min(self.n_sampled, self.n_unsampled) < MIN_COST_MEASUREMENTS:
            return None
        # a switch back never makes passes faster: a mean below zero is noise, and is not let lower
        # the estimate (the budget would sample more for it)
        return max(0.0, self.sampled_ns - self.unsampled_ns + max(0.0, self.after_ns)) * 1e-9


class Instrumentation:
    """What ``instrument`` installed; ``remove()`` restores the model."""

    def __init__(self, core: TimerCore, mode: str, name: str) -> None:
        self.core = core
        self.mode = mode
        self.ops: list[str] = []
        self.op_states: list[OpState] = []
        self.passes = 0
        self.sampled_passes = 0
        self.pass_state = core.new_pass_state(name)
        self.cost = PassCost()
        #: the same means in wall time, under ``torch.compile`` only (compiled.pass_call): what the
        #: thread's CPU leaves out (its waits off the CPU) against what it counts that a GPU-bound
        #: pass hides; read by the benchmarks beside ``cost``, not by the budget
        self.wall_cost = PassCost()
        #: the same means over each measured pass's step: from its start to the next pass's start,
        #: so what the program does after the call (its wait for the GPU) counts too. A timed pass
        #: whose kernels run longer on the GPU (its region marks split Inductor's fusions) costs
        #: nothing on the CPU in the call and shows only there, in a loop that waits each step; read
        #: by the benchmarks beside ``cost`` and ``wall_cost``, not by the budget
        self.step_cost = PassCost()
        self.wrappers: list[tuple[Any, Callable]] = []
        #: (module, its forward before instrument, op) of every chosen module
        self.chosen: list[tuple[Any, Callable, OpState]] = []
        #: the compiled-model state (compiled.py) once the model runs compiled, else None
        self.compiled: compiled_mod.CompiledRegions | None = None
        self._model: Any = None
        # the per-pass callable goes into _holder.__dict__[_key]; _saved: the instance attribute it
        # replaces there (an OptimizedModule's own forward, a module's compiled call), None if none
        self._holder: Any = None
        self._key = "forward"
        self._saved: Any = None
        self._hooks: list[str] = []  # instance attributes that catch a later compile
        self._attached = False
        self._entry_pass: Callable | None = None  # the sampler torch.compile(model) reaches
        self._pass_wrapper: Callable | None = None
        self._local = threading.local()

    def sampled_pass_cost_s(self) -> float | None:
        """What the budget charges a sampled pass: its measured extra CPU (``cost``), times
        ``compiled.UNSEEN_COST_FACTOR`` where the model runs under default torch.compile on a GPU
        (region marks recorded as the pass runs, on a CUDA route), whose timed passes cost more than
        that CPU shows. None until the means are trustworthy."""
        measured = self.cost.per_sampled_pass_s()
        regions = self.compiled
        if measured is None or regions is None or not regions.ran_eagerly:
            return measured
        return measured * compiled_mod.UNSEEN_COST_FACTOR if self.core.route.gpu_queue else measured

    def sequence(self) -> RegionSequence:
        """This thread's sequence (partition mode)."""
        try:
            return self._local.seq
        except AttributeError:
            seq = self._local.seq = new_sequence(self.core, "forward")
            return seq

    def entered_scale(self) -> float:
        """passes / sampled passes: turns counts from sampled passes into counts of all passes."""
        return self.passes / self.sampled_passes if self.sampled_passes else 0.0

    def samples_per_pass(self) -> int:
        return len(self.wrappers)

    def detach(self) -> None:
        """Stop timing the model, keeping counts, cost estimates and sampling state."""
        self._attached = False
        holder = self._holder
        if holder is not None:
            if self._saved is None:
                holder.__dict__.pop(self._key, None)
            else:
                holder.__dict__[self._key] = self._saved

    def attach(self) -> None:
        """Resume timing after ``detach()``."""
        self._attached = True
        if self._holder is not None:
            self._holder.__dict__[self._key] = self._pass_wrapper

    def remove(self) -> None:
        self.detach()
        if self._model is not None:
            for name in self._hooks:
                self._model.__dict__.pop(name, None)
            self._model = None
        self._holder = None
        for module, _ in self.wrappers:
            module.__dict__.pop("forward", None)
        if self.compiled is not None:
            self.compiled.remove()
        self.core.unregister_sampler(self)

    # --- compiled models (compiled.py) ----------------------------------------------------------

    def run_compiled(self, holder: Any, key: str | None, compiled: Callable) -> None:
        """Time the model through ``compiled`` from now on: per-module forwards become the traced
        wrappers, installed for good (dynamo inlines them), and the per-pass sampler takes
        ``holder.<key>``'s place (``key`` None: the caller calls ``_pass_wrapper`` itself)."""
        if self.compiled is None:
            self.detach()  # the eager pass wrapper must not be traced
            for module, _ in self.wrappers:
                module.__dict__.pop("forward", None)
            regions = compiled_mod.CompiledRegions(self, [op.name for _, _, op in self.chosen],
                                                   [op for _, _, op in self.chosen])
            self.wrappers = [(module, compiled_mod.traced_forward(regions, i, original))
                             for i, (module, original, _) in enumerate(self.chosen)]
            for module, wrapper in self.wrappers:
                module.__dict__["forward"] = wrapper
            self.mode = "exact"  # partition's shared boundaries do not apply: each region has two markers
            self.compiled = regions
        self._holder, self._key = (holder, key) if key is not None else (None, "forward")
        self._saved = holder.__dict__.get(key) if key is not None else None
        self._pass_wrapper = compiled_mod.pass_call(self, self.compiled, compiled, UNSAMPLED_MEASURE_EVERY)
        self.attach()

    def _watch_for_compile(self, model: Any) -> None:
        """Catch ``torch.compile(model)`` and ``model.compile()`` made after instrument(): the first
        takes ``model.__call__`` (an instance attribute wins), the second calls ``model.compile``."""
        inst = self
        model_type = type(model)

        def call_model(*args: Any, **kwargs: Any) -> Any:
            return model_type.__call__(model, *args, **kwargs)

        def switch() -> bool:
            if inst._model is None or not inst._attached:
                return False
            if inst.compiled is None:
                inst.run_compiled(model, None, call_model)
            if inst._entry_pass is None:
                inst._entry_pass = compiled_mod.pass_call(inst, inst.compiled, call_model,
                                                          UNSAMPLED_MEASURE_EVERY)
            return True

        def compiled_entry(*args: Any, **kwargs: Any) -> Any:
            # reached through the OptimizedModule of torch.compile(model), in a frame dynamo skips;
            # also by code that calls model.__call__ itself (transformers' generate does): eager then
            if not compiled_mod.dynamo_active():
                return call_model(*args, **kwargs)
            entry = inst._entry_pass
            if entry is None or not inst._attached:
                if not compiled_mod.untraced(switch):
                    return call_model(*args, **kwargs)
                entry = inst._entry_pass
            return entry(*args, **kwargs)

        def compile_in_place(*args: Any, **kwargs: Any) -> None:
            model_type.compile(model, *args, **kwargs)
            call = model.__dict__.get("_compiled_call_impl")
            if call is not None and inst._model is not None and inst._attached:
                inst.run_compiled(model, "_compiled_call_impl", call)

        model.__dict__["__call__"] = compiled_mod.skip_frame(compiled_entry)
        model.__dict__["compile"] = compile_in_place
        self._hooks = ["__call__", "compile"]


def _exact_forward(core: TimerCore, original: Callable, op: OpState) -> Callable:
    native = hot.exact_forward(core, op, original)  # the same steps in C, arguments passed through
    if native is not None:
        return native
    record_start, end = core.record_start, core.end

    def forward(*args: Any, **kwargs: Any) -> Any:
        op.entered += 1
        token = record_start()
        if token is None:
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            end(op, token, None)

    return forward


def _split_forward(inst: Instrumentation, original: Callable, op: OpState) -> Callable:
    local, get_seq = inst._local, inst.sequence
    native = hot.split_forward(inst.core, local, get_seq, op, original)  # the same steps in C
    if native is not None:
        return native

    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            seq = local.seq
        except AttributeError:
            seq = get_seq()
        seq.split(op)
        return original(*args, **kwargs)

    return forward


def _pass_forward(inst: Instrumentation, original: Callable) -> Callable:
    core, state, cost, wrappers = inst.core, inst.pass_state, inst.cost, inst.wrappers
    partition = inst.mode == "partition"
    clock = time.thread_time_ns

    def unsampled(args: tuple, kwargs: dict) -> Any:
        if inst.passes % UNSAMPLED_MEASURE_EVERY:
            return original(*args, **kwargs)
        t0 = clock()
        try:
            return original(*args, **kwargs)
        finally:
            cost.add(False, clock() - t0)

    def timed(args: tuple, kwargs: dict) -> Any:
        for module, wrapper in wrappers:
            module.__dict__["forward"] = wrapper
        seq = inst.sequence() if partition else None
        if seq is not None:
            seq.begin(sampled=True)
        try:
            return original(*args, **kwargs)
        finally:
            if seq is not None:
                seq.end()
            for module, _ in wrappers:
                module.__dict__.pop("forward", None)

    def traced(args: tuple, kwargs: dict, busy: Any) -> Any:
        # A pass under the kernel busy window (busy.py): every module an exact region under its
        # own CUPTI correlation id. Its cost is the window's, not fed to the pass cost estimate.
        forwards = busy.open(inst.op_states, [module.forward for module, _ in wrappers])
        if forwards is None:
            return timed(args, kwargs)
        for (module, _), wrapper in zip(wrappers, forwards, strict=True):
            module.__dict__["forward"] = wrapper
        t0 = clock()
        try:
            return original(*args, **kwargs)
        finally:
            for module, _ in wrappers:
                module.__dict__.pop("forward", None)
            busy.close_pass((clock() - t0 - cost.sampled_ns) * 1e-9)

    def captured(args: tuple, kwargs: dict) -> Any:
        # A pass captured into a CUDA graph: timed when a TimedGraph is capturing a timed copy
        # (its regions become event nodes, see graphs.py), else left out of the graph.
        recorder = core.graph_recorder()
        if recorder is None:
            core.note_capture()
            return original(*args, **kwargs)
        return timed(args, kwargs) if recorder.times_regions else original(*args, **kwargs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if core.capture_in_progress():  # not a pass that runs now: it is being recorded
            return captured(args, kwargs)
        inst.passes += 1
        countdown = state.countdown
        if countdown:
            state.countdown = countdown - 1
            return unsampled(args, kwargs)
        state.countdown = state.period - 1
        inst.sampled_passes += 1
        busy = core.busy
        if busy is not None and busy.due():
            return traced(args, kwargs, busy)
        t0 = clock()
        try:
            return timed(args, kwargs)
        finally:
            cost.add(True, clock() - t0)

    return forward


def instrument(timer: Timer, model: Any, include: Any = None, *, mode: str = "exact",
               op_name: Callable[[str], str] | None = None) -> Instrumentation:
    """Time the submodules of ``model`` that ``include`` selects.

    Args:
        include: None (``DEFAULT_NAMES`` and embedding/attention module types), module-name
            suffixes or glob patterns over module paths, or ``fn(path, module) -> bool``.
        mode: "exact" or "partition" (module docstring).
        op_name: maps a module path (``blocks.3.attn``) to the op label; default: the path.
    """
    if mode not in ("exact", "partition"):
        raise ValueError(f"mode must be 'exact' or 'partition', got {mode!r}")
    target = compiled_mod.compiled_target(model)
    if target is not None:
        return _instrument_compiled(timer, target, include, mode, op_name)
    if "forward" in model.__dict__:
        raise ValueError("instrument(): the model is already instrumented (or has an instance forward)")
    inst = _instrument_modules(timer, model, include, mode, op_name)
    inst._pass_wrapper = _pass_forward(inst, model.forward)
    inst._model = inst._holder = model
    inst.attach()
    inst._watch_for_compile(model)
    timer.core.register_sampler(inst)
    return inst


def _instrument_compiled(timer: Timer, target: tuple[str, Any], include: Any, mode: str,
                         op_name: Callable[[str], str] | None) -> Instrumentation:
    kind, obj = target
    root = obj._orig_mod if kind == "optimized" else obj
    key = "forward" if kind == "optimized" else "_compiled_call_impl"
    current = obj.__dict__.get(key)
    if root.__dict__.get("_gpuscope_compiled") or "forward" in root.__dict__:
        raise ValueError("instrument(): the model is already instrumented (or has an instance forward)")
    inst = _instrument_modules(timer, root, include, mode, op_name)
    inst._model = root
    inst.run_compiled(obj, key, current)
    root.__dict__["_gpuscope_compiled"] = True
    inst._hooks = ["_gpuscope_compiled"]
    timer.core.register_sampler(inst)
    return inst


def _instrument_modules(timer: Timer, model: Any, include: Any, mode: str,
                        op_name: Callable[[str], str] | None) -> Instrumentation:
    """The chosen modules of ``model`` with their eager wrappers (not installed yet)."""
    match = _matcher(include)
    name_of = op_name or (lambda path: path)
    chosen: list[tuple[str, Any]] = []
    for path, module in model.named_modules():
        if not path or not match(path, module):
            continue
        if mode == "partition" and any(path.startswith(p + ".") for p, _ in chosen):
            continue
        if "forward" in module.__dict__:
            raise ValueError(f"instrument(): module {path!r} already has an instance forward")
        chosen.append((path, module))
    if not chosen:
        raise ValueError("instrument(): no submodule matched include=" + repr(include))
    core = timer.core
    inst = Instrumentation(core, mode, f"pass:{type(model).__name__}")
    for path, module in chosen:
        op = core.op_state(name_of(path))
        op.owner = inst
        inst.ops.append(op.name)
        inst.op_states.append(op)
        wrapper = (_exact_forward(core, module.forward, op) if mode == "exact"
                   else _split_forward(inst, module.forward, op))
        inst.wrappers.append((module, wrapper))
        inst.chosen.append((module, module.forward, op))
    return inst


__all__ = ["DEFAULT_NAMES", "Instrumentation", "PassCost", "instrument"]
