"""Probe: can CUPTI tie a replayed CUDA graph's kernels to the module that launched them at capture?

Captures a small layered model into a CUDA graph with a CUPTI callback subscriber on graph-node
creation and cloning, labels each created node with the layer being captured, replays the graph
with kernel activity on, and reports how many replayed kernels map back to a label, with the
kernel time per label and the replay's cost with and without kernel activity.

    python benchmarks/cupti_graph_probe.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from cupti import cupti

    result: dict = {"errors": []}
    label = ["none"]
    created: dict[int, str] = {}
    cloned: dict[int, int] = {}
    seen_args: list[str] = []

    def graph_data(cbdata):
        rd = cbdata if hasattr(cbdata, "resource_descriptor") else cupti.ResourceData.from_ptr(cbdata)
        return cupti.GraphData.from_ptr(rd.resource_descriptor)

    def callback(userdata, domain, cbid, cbdata):
        try:
            if len(seen_args) < 3:
                seen_args.append(repr((type(userdata).__name__, domain, cbid, type(cbdata).__name__)))
            data = graph_data(cbdata)
            if cbid == int(cupti.CallbackIdResource.GRAPHNODE_CREATED):
                created[cupti.get_graph_node_id(data.node)] = label[0]
            elif cbid == int(cupti.CallbackIdResource.GRAPHNODE_CLONED):
                cloned[cupti.get_graph_node_id(data.node)] = cupti.get_graph_node_id(data.original_node)
        except Exception:
            if len(result["errors"]) < 5:
                result["errors"].append(traceback.format_exc())

    records: list = []

    def buffer_requested():
        return 8 << 20, 0

    def buffer_completed(activities):
        records.extend(activities)

    cupti.activity_register_callbacks(buffer_requested, buffer_completed)
    subscriber = cupti.subscribe(callback, None)
    domain = cupti.CallbackDomain.RESOURCE
    for cbid in (cupti.CallbackIdResource.GRAPHNODE_CREATED, cupti.CallbackIdResource.GRAPHNODE_CLONED):
        cupti.enable_callback(1, subscriber, domain, cbid)

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.LayerNorm(2048))
              for _ in range(4)]
    model = torch.nn.ModuleList(layers).cuda().to(torch.bfloat16)
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)

    def forward(inp):
        for i, layer in enumerate(model):
            label[0] = f"layer{i}"
            inp = layer(inp)
        label[0] = "none"
        return inp

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(x)
    torch.cuda.synchronize()
    result["callback_args"] = seen_args
    result["created_nodes"] = len(created)
    result["cloned_nodes"] = len(cloned)
    result["labels_created"] = sorted(set(created.values()))

    def replays(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    replays(50)
    plain = [replays(200) for _ in range(3)]
    kinds = cupti.ActivityKind
    cupti.activity_enable(kinds.CONCURRENT_KERNEL)
    traced = [replays(200) for _ in range(3)]
    cupti.activity_disable(kinds.CONCURRENT_KERNEL)
    cupti.activity_flush_all(1)
    result["replay_us_plain"] = [round(1e6 * t, 2) for t in plain]
    result["replay_us_kernel_activity"] = [round(1e6 * t, 2) for t in traced]

    kernels = [r for r in records if r.kind == int(kinds.CONCURRENT_KERNEL)]
    result["kernel_records"] = len(kernels)
    attrs = [a for a in dir(kernels[0]) if "graph" in a] if kernels else []
    result["kernel_graph_attrs"] = attrs
    by_label: dict[str, int] = {}
    direct = via_clone = unmapped = 0
    for record in kernels:
        node = getattr(record, "graph_node_id", 0)
        name = created.get(node)
        if name is not None:
            direct += 1
        else:
            original = cloned.get(node)
            name = created.get(original) if original is not None else None
            if name is not None:
                via_clone += 1
        if name is None:
            unmapped += 1
            name = "unmapped"
        by_label[name] = by_label.get(name, 0) + record.end - record.start
    result["mapped_direct"] = direct
    result["mapped_via_clone"] = via_clone
    result["unmapped"] = unmapped
    n_replays = 600
    result["kernel_us_per_replay_by_label"] = {k: round(v / 1e3 / n_replays, 2)
                                               for k, v in sorted(by_label.items())}
    result["sample_kernel_names"] = sorted({getattr(r, "name", "?")[:60] for r in kernels})[:8]
    cupti.unsubscribe(subscriber)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
