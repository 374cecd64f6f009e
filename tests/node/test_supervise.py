"""Supervision: watchdog stall reports, gossip rebuilt after p2pd is SIGKILLed, out-of-memory split-and-retry."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace

import psutil
import pytest

from hivespec.node.config import SwarmConfig, load_config
from hivespec.node.model.footprint import ModelShape, config_peak_bytes
from hivespec.node.model.loader import load_model
from hivespec.node.progress import RoundProgress
from hivespec.node.status.board import RunControl
from hivespec.node.supervise import MicroBatchFit, Watchdog, is_out_of_memory
from hivespec.node.swarm.gossip import Gossip
from hivespec.node.swarm.supervisor import Backoff, GossipSupervisor
from hivespec.node.training.trainer import Trainer, TrainSample
from hivespec.protocol.identity import Identity


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


_TRIM_CHILD = textwrap.dedent("""
    import ctypes, ctypes.util
    import psutil
    from hivespec.node.supervise import HeapTrimmer
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    size, count = 64 * 1024, 4096  # 256 MiB in chunks below glibc's mmap threshold: from the heap
    chunks = [libc.malloc(size) for _ in range(count)]
    for chunk in chunks:
        libc.memset(chunk, 1, size)
    for i, chunk in enumerate(chunks):
        if i % 64:  # one in 64 kept: the heap cannot shrink from its top, its free pages stay resident
            libc.free(chunk)
    clock = [0.0]
    trimmer = HeapTrimmer(every_s=30.0, clock=lambda: clock[0])
    before = psutil.Process().memory_info().rss
    assert not trimmer.maybe_trim() and trimmer.resident_mb is None  # not due yet, nothing measured
    clock[0] = 30.0
    assert trimmer.maybe_trim()
    after = psutil.Process().memory_info().rss
    assert abs(trimmer.resident_mb - after / 1e6) < 16  # the floor it reports is this process's RSS right after
    assert not trimmer.maybe_trim()  # due again only 30 s later
    print((before - after) / 2**20)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_the_heap_trimmer_gives_freed_pages_back_when_due():
    """A node's RSS must follow what it keeps, not its largest round: 252 of 256 MiB freed go back to the OS."""
    out = subprocess.run([sys.executable, "-P", "-c", _TRIM_CHILD], check=True, capture_output=True, text=True, timeout=120)
    given_back_mib = float(out.stdout.strip())
    assert given_back_mib > 200


_PEAK_CHILD = textwrap.dedent("""
    import psutil, torch
    from hivespec.node.process_memory import peak_resident_mb
    start = peak_resident_mb()
    block = torch.ones(64 * 2**20)  # 256 MiB, touched
    held = psutil.Process().memory_info().rss / 1e6
    del block
    print(start, held, peak_resident_mb(), psutil.Process().memory_info().rss / 1e6)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_the_peak_resident_memory_keeps_a_freed_step_s_high_water_mark():
    """What a node reports as the memory it needs: the most it held, not what it holds between steps."""
    out = subprocess.run([sys.executable, "-P", "-c", _PEAK_CHILD], check=True, capture_output=True, text=True, timeout=120)
    start, held, peak, now = map(float, out.stdout.split())
    assert peak >= held - 1 > start + 200  # the 256 MiB block counted while it lived
    assert now < peak - 200  # and kept in the peak after it was freed


def test_watchdog_reports_a_silent_loop_once_per_period_and_its_recovery(caplog):
    clock = _Clock()
    watchdog = Watchdog(stall_after=60, check_every=1, clock=clock)
    watchdog.beat("round", "rollout")
    clock.now += 59
    assert watchdog.check() == []
    clock.now += 2
    with caplog.at_level(logging.ERROR, logger="hivespec.node.supervise"):
        assert watchdog.check() == ["round"]
        assert watchdog.check() == ["round"]  # still stalled, not reported twice in one period
    assert caplog.text.count("loop 'round' made no progress for 61 s (last phase 'rollout')") == 1
    assert "--- thread MainThread ---" in caplog.text
    assert watchdog.status()["round"]["stalled"] is True and watchdog.stalls() == 1
    clock.now += 60
    watchdog.check()
    assert watchdog.stalls() == 2
    with caplog.at_level(logging.WARNING, logger="hivespec.node.supervise"):
        watchdog.beat("round", "train")
    assert "made progress again" in caplog.text
    assert watchdog.check() == [] and watchdog.status()["round"]["phase"] == "train"


def test_decode_steps_and_micro_batches_are_heartbeats_of_the_round_loop():
    """A phase longer than stall_after that makes progress (a training step of many micro batches: a larger model on a
    slow CPU) was reported as a stall, every thread's stack in the log, as only a phase's start beat the watchdog."""
    clock = _Clock()
    watchdog = Watchdog(stall_after=600, check_every=1, clock=clock)
    progress = RoundProgress(RunControl(), watchdog=watchdog)
    on_tokens, between = progress.generating(0, total=16), progress.training(0)
    steps = {"rollout": lambda: on_tokens(16), "train": lambda: between(0, 4)}  # a decode step, a micro batch
    for phase, step in steps.items():
        progress.beat(phase)
        for _ in range(4):
            clock.now += 400
            step()
            assert watchdog.check() == [], phase
        assert watchdog.status()["round"]["phase"] == phase
    clock.now += 601  # no step for a whole stall_after: that is a stall
    assert watchdog.check() == ["round"]


def test_watchdog_probes_beat_a_loop_only_while_healthy():
    clock = _Clock()
    healthy = {"value": True}
    watchdog = Watchdog(stall_after=30, check_every=1, clock=clock)
    watchdog.watch("gossip", lambda: healthy["value"], every=5, stall_after=30)
    for _ in range(10):
        clock.now += 5
        assert watchdog.check() == []
    healthy["value"] = False
    stalled = []
    for _ in range(8):
        clock.now += 5
        stalled.append(watchdog.check())
    assert stalled[-1] == ["gossip"] and stalled[0] == []
    watchdog.forget("gossip")
    assert watchdog.check() == []


def test_backoff_doubles_up_to_its_cap():
    backoff = Backoff(initial=1, factor=2, maximum=10)
    assert [backoff.next_delay() for _ in range(6)] == [1, 2, 4, 8, 10, 10]
    backoff.reset()
    assert backoff.next_delay() == 1


def _p2pd_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "p2pd" in p.name()]


@pytest.mark.timeout(180)
def test_gossip_is_rebuilt_with_the_same_identity_after_p2pd_is_sigkilled():
    identity = Identity.generate()
    built = []

    def factory() -> Gossip:
        gossip = Gossip(identity, SwarmConfig(swarm="supervise-test", request_timeout=5.0))
        gossip.start()
        built.append(gossip)
        return gossip

    supervisor = GossipSupervisor(factory, factory(), probe_timeout=3.0)
    try:
        assert supervisor.healthy()
        assert supervisor.check() is built[0]
        before = {p.pid for p in _p2pd_children()}
        assert len(before) == 1
        os.kill(before.pop(), signal.SIGKILL)
        rebuilt = supervisor.check()
        assert rebuilt is built[1] and supervisor.restarts == 1
        assert supervisor.healthy()
        assert rebuilt.identity.peer_id == identity.peer_id
        rebuilt.publish_rollouts(b"still gossiping after the restart", version=0)
        assert len(_p2pd_children()) == 1
    finally:
        for gossip in built:
            gossip.shutdown()


def test_a_failing_rebuild_backs_off_without_blocking_the_caller():
    clock = _Clock()

    class _Dead:
        identity = None

        def healthy(self, timeout: float) -> bool:
            return False

        def shutdown(self) -> None:
            pass

    attempts = []

    def factory():
        attempts.append(clock.now)
        raise OSError("port in use")

    dead = _Dead()
    supervisor = GossipSupervisor(factory, dead, backoff=Backoff(initial=2, factor=2, maximum=8), clock=clock)
    for _ in range(30):
        assert supervisor.check() is dead
        clock.now += 1
    assert [a - attempts[0] for a in attempts] == [0, 2, 6, 14, 22]  # waits of 2, 4, 8, then the 8 s cap
    assert supervisor.failures == 5 and supervisor.restarts == 0


def test_a_failing_rebuild_is_one_line_at_each_try(caplog):
    """A swarm port taken by another program: each try of the rebuild had logged gossip's whole traceback, where the
    error's own line says what to check."""
    from hivespec.node.swarm.gossip import GossipError

    clock = _Clock()
    why = "could not start hivemind on /ip4/0.0.0.0/tcp/31337 (start_timeout=30 s, initial peers=[]): Check that the port is free"

    class _Dead:
        def healthy(self, timeout: float) -> bool:
            return False

        def shutdown(self) -> None:
            pass

    def factory():
        raise GossipError(why)

    supervisor = GossipSupervisor(factory, _Dead(), backoff=Backoff(initial=2, factor=2, maximum=8), clock=clock)
    with caplog.at_level(logging.DEBUG, logger="hivespec.node.swarm.supervisor"):
        for _ in range(3):  # tries at 0 and 2 s; at 4 s the next (6 s) is not due
            supervisor.check()
            clock.now += 2
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR and "rebuild failed" in r.getMessage()]
    assert supervisor.failures == 2 and all(record.exc_info is None for record in failed)
    assert [r.getMessage() for r in failed] == [
        f"gossip rebuild failed (GossipError: {why}); next try in {delay} s, rounds run solo meanwhile" for delay in (2, 4)]


def test_is_out_of_memory_recognises_cpu_cuda_and_python_errors():
    import torch

    try:
        torch.empty(1 << 62, dtype=torch.uint8)
    except RuntimeError as exc:
        assert is_out_of_memory(exc)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_the_micro_batch_follows_the_memory_available_before_each_step_and_says_when_it_moves(caplog):
    """Other programs take memory while a node runs, then give it back: each step trains in what fits then (the
    figures here are given; tests/node/test_memory_fit.py runs a node in a real control group)."""
    config = load_config("demo")
    config = replace(config, model=replace(config.model, autocast=True, engine_dtype="bfloat16"))
    shape = ModelShape(params=134_515_008, layers=30, hidden=576, intermediate=1536, heads=9)  # SmolLM2-135M
    need = config_peak_bytes(config, shape)
    free = [need]
    fit = MicroBatchFit(config, shape, available=lambda: free[0], resident=lambda: 0)
    trainer = Trainer(load_model("tiny"), learning_rate=1e-3, micro_batch_size=8, autocast_dtype=None)
    caplog.set_level(logging.INFO, logger="hivespec.node.supervise")

    def said() -> list[tuple[int, str]]:
        return [(r.levelno, r.getMessage()) for r in caplog.records]

    assert fit.fit(trainer) == 8 and said() == []  # it fits: nothing said
    free[0] = need * 9 // 10
    shrunk = fit.fit(trainer)
    assert 1 < shrunk < 8 and trainer.micro_batch_size == shrunk
    assert len(said()) == 1 and said()[0][0] == logging.WARNING
    assert said()[0][1].startswith(f"memory: training in micro batches of {shrunk} samples, not 8")
    assert fit.fit(trainer) == shrunk and len(said()) == 1  # the same choice is said once
    longer = [TrainSample(tuple(range(400)), (1,) * 200, (-1.0,) * 200, 1.0, "g")]  # a step of longer rows: fewer at once
    smaller = fit.fit(trainer, longer)
    assert smaller < shrunk and said()[-1][0] == logging.INFO  # moving between smaller ones: a line, not a warning
    assert said()[-1][1].startswith(f"memory: training in micro batches of {smaller} sample")
    assert fit.fit(trainer) == shrunk and len(said()) == 3
    free[0] = need // 100
    assert fit.fit(trainer) == 1 and said()[-1][0] == logging.WARNING and "the kernel may stop it mid-round" in said()[-1][1]
    assert fit.fit(trainer) == 1 and len(said()) == 4
    free[0] = need
    assert fit.fit(trainer) == 8 and said()[-1] == (logging.INFO, f"memory: training in micro batches of 8 samples again ({need / (1 << 30):.1f} GiB available)")
    # An out-of-memory retry (a GPU's) halved it in a step: later steps stay within that, however much is free.
    trainer.micro_batch_size = 4
    assert fit.fit(trainer) == 4 and fit.ceiling == 4 and len(said()) == 5
    free[0] = need * 9 // 10
    assert fit.fit(trainer) == min(4, shrunk)


_OOM_CHILD = textwrap.dedent(
    """
    import json, resource, sys, torch
    from hivespec.node.model.engine import GenerationRequest, SamplingParams, TorchEngine
    from hivespec.node.model.loader import load_model, load_tokenizer
    from hivespec.node.supervise import generate_splitting_on_oom, train_step_with_oom_retry
    from hivespec.node.training.trainer import Trainer, TrainSample

    tokenizer = load_tokenizer("tiny")
    engine = TorchEngine(load_model("tiny"), max_batch_size=64)
    prompt = tuple(tokenizer.encode("hello " * 60))
    requests = [GenerationRequest(prompt, seed=1, sample_index=i) for i in range(64)]
    params = SamplingParams(max_new_tokens=4)
    reference = [s.completion_ids for s in engine.generate(requests[:4], params)]
    model = load_model("tiny"); model.requires_grad_(True)
    trainer = Trainer(model, learning_rate=1e-3, micro_batch_size=64, autocast_dtype=None)
    samples = [TrainSample(prompt, (5, 6, 7, 8), (-1.0,) * 4, float(i % 2), "g%d" % (i // 4)) for i in range(64)]
    # From here on the address space may grow by only a little: big batches fail for real.
    vm = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[1]) * 2**20, resource.RLIM_INFINITY))
    splits, retries = [], []
    out = generate_splitting_on_oom(lambda chunk: engine.generate(chunk, params), requests, on_split=splits.append)
    stats = train_step_with_oom_retry(trainer, samples, on_retry=retries.append)
    print(json.dumps({
        "splits": splits, "retries": retries, "same": [s.completion_ids for s in out[:4]] == reference,
        "count": len(out), "version": stats.version, "trained": stats.trained_samples,
    }))
    """
)


@pytest.mark.timeout(300)
def test_out_of_memory_from_a_real_allocation_splits_generation_and_shrinks_training_batches():
    # RLIMIT_AS makes the allocator fail for real (no mock); the headroom that makes a 64-row
    # batch fail but a smaller one fit depends on the allocator, so try a few.
    outcomes = []
    for headroom_mb in (40, 60, 90, 130):
        result = subprocess.run([sys.executable, "-P", "-c", _OOM_CHILD, str(headroom_mb)], check=False, capture_output=True, text=True, timeout=240)
        if result.returncode != 0:
            outcomes.append((headroom_mb, result.stderr.strip().splitlines()[-1:]))
            continue
        report = json.loads(result.stdout.strip().splitlines()[-1])
        outcomes.append((headroom_mb, report))
        if report["splits"] and report["retries"]:
            assert report["same"] and report["count"] == 64  # keyed sampling: a split changes no completion
            assert report["version"] == 1 and report["trained"] == 64
            assert report["retries"][0] == 32
            assert "out of memory generating 64 completions" in result.stderr
            assert "retrying with 32" in result.stderr
            return
    pytest.fail(f"no headroom made both generation and training run out of memory and recover: {outcomes}")
