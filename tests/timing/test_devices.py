"""Several devices and streams, with a fake route that knows which device each event belongs to."""

import threading

from tests.timing.conftest import ScriptedRoute


class MultiDeviceRoute(ScriptedRoute):
    """Models what CUDA checks across devices, so wrong-device calls fail here as they do on a GPU.

    - The current device is per thread, and a new thread starts on device 0.
    - An event belongs to the device current when it was created; recording it on another device's
      stream, or querying or timing it while another device is current, fails with error 400
      (``cudaErrorInvalidResourceHandle``).
    - A failed call leaves its error in the calling thread's last-error slot until
      ``clear_error`` (``cudaGetLastError``) takes it: torch raises whatever is left there after
      its next kernel launch.
    - Devices get a context when they are first made current (``contexts``), and so does a thread's
      current device when the thread first makes a runtime call that needs one: measured on two
      H200s, ``cudaThreadExchangeStreamCaptureMode`` on a fresh thread opened a context on GPU 0.
    """

    on_host = False  # label samples by device number

    def __init__(self):
        super().__init__()
        self.local = threading.local()
        self.wrong_device = 0
        self.last_error: dict[str, int] = {}  # thread name → error left in its slot
        self.contexts: set[int] = set()

    def _fail(self) -> int:
        self.wrong_device += 1
        self.last_error[threading.current_thread().name] = 400
        return 400

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def current_stream(self, device: int) -> int:
        return 100 * device + getattr(self.local, "stream", 0)

    def use_device(self, device: int) -> int:
        previous = self.current_device()
        self.local.device = device
        self.contexts.add(device)
        return previous

    def has_context(self, device: int) -> bool:
        return device in self.contexts

    def clear_error(self) -> None:
        self.last_error.pop(threading.current_thread().name, None)

    def relax_capture_mode(self) -> None:
        self.contexts.add(self.current_device())

    def create(self):
        self.contexts.add(self.current_device())
        event = super().create()
        event.append(self.current_device())
        return event

    def record(self, event, stream):
        if event[1] != stream // 100:
            return self._fail()
        return super().record(event, stream)

    def query(self, event) -> bool:
        if event[1] != self.current_device():
            self._fail()
            return False
        return super().query(event)

    def elapsed_s(self, start, end) -> float:
        if start[1] != self.current_device() or end[1] != self.current_device():
            self._fail()
            raise RuntimeError("cudaEventElapsedTime failed with CUDA error 400")
        return super().elapsed_s(start, end)


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
    assert sorted(timer.core.pools) == [0, 1]
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


def test_a_timer_made_on_one_thread_times_another_threads_device(make_timer, registry):
    """A server makes its timer on the main thread (device 0) and runs its model on cuda:1 in an
    engine thread; the resolver thread (also on device 0 at birth) calibrates and resolves device
    1's events. Every call must run on device 1, leave no error behind, and touch no device 0."""
    route = MultiDeviceRoute()
    timer = make_timer(route=route, sample_rate=1.0)
    errors_seen_by_engine = []

    def engine():
        route.use_device(1)
        for _ in range(200):
            with timer.region("step"):
                pass
        assert timer.flush(10)
        errors_seen_by_engine.append(route.last_error.get(threading.current_thread().name))

    thread = threading.Thread(target=engine, name="engine")
    thread.start()
    thread.join()
    assert timer.flush(10)
    assert route.wrong_device == 0
    assert route.last_error == {} and errors_seen_by_engine == [None]
    assert registry.get_sample_value("gpuscope_timer_dropped_samples_total", {"reason": "error"}) == 0
    assert count(registry, "op", "1") is None and count(registry, "step", "1") == 200
    assert registry.get_sample_value("gpuscope_timer_baseline_seconds", {"device": "1"}) > 0
    assert 0 not in route.contexts, "the timer opened a context on a device the program never used"


def test_failed_calls_leave_no_error_for_torch_to_find(make_timer, registry):
    """An event recorded on a foreign stream fails; the failure is counted and the thread's
    last-error slot is empty again, on the recording thread and on the resolver's."""
    route = MultiDeviceRoute()
    route.current_stream = lambda device: 100 * (device + 1)  # a stream of the wrong device
    timer = make_timer(route=route, sample_rate=1.0)
    with timer.region("op"):
        pass
    timer.flush(1)  # calibration runs before the first drain: it fails on the same stream
    assert route.wrong_device >= 2
    assert route.last_error == {}
    assert timer.dropped["error"] >= 1
