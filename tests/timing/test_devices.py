"""Several devices and streams, with a fake route that knows which device each event belongs to."""

import threading

from tests.timing.conftest import ScriptedRoute


class MultiDeviceRoute(ScriptedRoute):
    """Events belong to the device current when they were created (as CUDA's do); recording one on
    another device's stream fails the way CUDA does, and is counted here."""

    on_host = False  # label samples by device number

    def __init__(self):
        super().__init__()
        self.local = threading.local()
        self.wrong_device = 0

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def current_stream(self, device: int) -> int:
        return 100 * device + getattr(self.local, "stream", 0)

    def create(self):
        event = super().create()
        event.append(self.current_device())
        return event

    def record(self, event, stream):
        if event[1] != stream // 100:
            self.wrong_device += 1
            return 400  # cudaErrorInvalidResourceHandle
        return super().record(event, stream)


def count(registry, op, device):
    return registry.get_sample_value("gpuscope_region_gpu_seconds_count", {"op": op, "device": device})


def test_one_thread_per_device(make_timer, registry):
    route = MultiDeviceRoute()
    timer = make_timer(route=route, sample_rate=1.0, ring_size=10_000, pool_size=10_000)

    def work(device, stream):
        route.local.device, route.local.stream = device, stream
        for _ in range(1000):
            with timer.region("op"):
                pass

    threads = [threading.Thread(target=work, args=(d, s)) for d, s in ((0, 1), (1, 2), (1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert timer.flush(10)
    assert route.wrong_device == 0
    assert sum(timer.dropped.values()) == 0
    assert (count(registry, "op", "0"), count(registry, "op", "1")) == (1000, 2000)
    assert sorted(timer._free) == [0, 1]
    assert registry.get_sample_value("gpuscope_timer_baseline_seconds", {"device": "1"}) is not None


def test_one_thread_switching_devices(make_timer, registry):
    route = MultiDeviceRoute()
    timer = make_timer(route=route, sample_rate=1.0)
    for i in range(600):
        route.local.device = i % 3
        with timer.region("op"):
            pass
    assert timer.flush(10)
    assert route.wrong_device == 0
    assert [count(registry, "op", str(d)) for d in range(3)] == [200, 200, 200]
    assert registry.get_sample_value("gpuscope_timer_dropped_samples_total", {"reason": "error"}) == 0
