"""P/D connector with producer and consumer engines in one process (fast, deterministic)."""
from __future__ import annotations

import threading
import time

import msgpack
import pytest
import torch
import zmq

from connectors.pipes.base import HandshakeError
from connectors.transfer_params import RecvKV, SendKV
from pd_cluster import SamplingParams
from pd_cluster.request import RequestStatus
from tests import pd_helpers
from tests.pd_helpers import (colocated_tokens, prompts_of_lengths, run_in_process,
                              submit_pair)

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def engine(model: str, role: str, **args):
    """These tests are of the ZMQ pipe's messages (frames, FINs, ACKs): pinned to it."""
    return pd_helpers.engine(model, role, pipe="zmq", **args)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from pd_cluster.checkpoints.maker import make_model
    return str(make_model(tmp_path_factory.mktemp("pd") / "m", arch="llama", num_layers=3))


def test_pd_matches_colocated_with_chunked_prefill_and_seeds(model):
    prompts = prompts_of_lengths([1, 7, 8, 9, 16, 40, 100, 3, 64, 65, 23, 5, 130, 12, 31, 2])
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.9, seed=100 + i, max_tokens=10,
                                                  ignore_eos=True) for i in range(len(prompts))]
    d = engine(model, "consumer", block_size=8)
    p = engine(model, "producer", block_size=8, max_num_batched_tokens=24)
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        submit_pair(p, d, f"r{i}", prompt, sp, d.kv_endpoint())
    got = run_in_process(p, d)
    assert [got[f"r{i}"] for i in range(len(prompts))] == colocated_tokens(model, prompts, params,
                                                                            block_size=8)
    assert d.stats()["kv_fallbacks"] == 0
    assert p.stats()["kv_bytes_sent"] == d.stats()["kv_bytes_received"] > 0
    assert p.stats()["kv_send_seconds"] > 0 and d.stats()["kv_recv_seconds"] > 0
    # issue 42: the pipe of each link, for `pd-cluster status` and /metrics' pipe= label
    assert p.stats()["kv_links"] == {d.kv_endpoint(): "zmq"} and d.stats()["kv_pipe"] == "zmq"
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


def test_consumer_blocks_bitwise_equal_to_producer(model):
    d = engine(model, "consumer", block_size=8, enable_prefix_caching=False)
    p = engine(model, "producer", block_size=8, enable_prefix_caching=False,
               max_num_batched_tokens=16)
    prompt = prompts_of_lengths([45])[0]
    submit_pair(p, d, "x", prompt, SamplingParams(temperature=0, max_tokens=1), d.kv_endpoint())
    d.step()  # allocates D's blocks and parks the request
    d_blocks = list(d.scheduler.remote_waiting["x"].block_ids)
    p.step()
    p_blocks = list(p.scheduler.requests["x"].block_ids)
    run_in_process(p, d)
    for pc, dc in zip(p.runner.kv_caches, d.runner.kv_caches):
        ours = pc[:, p_blocks].flatten(1, 2)[:, :45]
        theirs = dc[:, d_blocks].flatten(1, 2)[:, :45]
        assert torch.equal(ours, theirs)
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


def test_consumer_timeout_falls_back_to_local_prefill(model):
    d = engine(model, "consumer", timeout=0.5, block_size=16)
    prompt = prompts_of_lengths([37])[0]
    d.add_request("lonely", prompt, GREEDY, RecvKV())
    d.step()
    assert d.scheduler.remote_waiting["lonely"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    done, deadline = {}, time.monotonic() + 20
    while d.has_unfinished_requests() and time.monotonic() < deadline:
        done.update({o.request_id: o.outputs[0].token_ids for o in d.step() if o.finished})
        time.sleep(0.01)
    assert done["lonely"] == colocated_tokens(model, [prompt], [GREEDY])[0]
    assert d.stats()["kv_fallbacks"] == 1
    d.check_no_leaks()
    d.close()


def test_abort_frees_blocks_on_both_sides(model):
    d = engine(model, "consumer", timeout=5, block_size=8)
    p = engine(model, "producer", timeout=1, block_size=8, max_num_batched_tokens=8)
    prompts = prompts_of_lengths([60, 60, 20])
    for i, prompt in enumerate(prompts):
        submit_pair(p, d, f"a{i}", prompt, GREEDY, d.kv_endpoint())
    d.step()
    p.step()
    assert d.scheduler.remote_waiting and p.block_manager.num_used_blocks > 0
    d.abort_request(["a0"])  # consumer side, still WAITING_FOR_REMOTE_KV
    p.abort_request(["a1"])  # producer side, mid chunked prefill: consumer falls back
    got = run_in_process(p, d)
    assert set(got) == {"a1", "a2"}
    ref = colocated_tokens(model, prompts[1:], [GREEDY, GREEDY], block_size=8)
    assert [got["a1"], got["a2"]] == ref
    assert d.stats()["kv_fallbacks"] == 1
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


def test_handshake_rejects_mismatched_layout(model):
    d = engine(model, "consumer", block_size=16)
    p = engine(model, "producer", timeout=1, block_size=8)
    with pytest.raises(HandshakeError, match="block_size"):
        p.runner.connector.connect_peer(d.kv_endpoint())
    # In the request flow the producer logs, frees its blocks and keeps serving.
    p.add_request("m", prompts_of_lengths([20])[0], SamplingParams(temperature=0, max_tokens=1),
                  SendKV(to=d.kv_endpoint()))
    deadline = time.monotonic() + 10
    while p.has_unfinished_requests() and time.monotonic() < deadline:
        p.step()
    p.check_no_leaks()
    p.close(), d.close()


def test_malformed_frames_do_not_kill_the_receiver(model):
    d = engine(model, "consumer", block_size=8)
    p = engine(model, "producer", block_size=8)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.kv_endpoint())
    garbage = [[b"\x00\xff" * 50], [b"not msgpack", b"x" * 100], [msgpack.packb({"kind": "kv"})],
               [msgpack.packb({"kind": "kv", "request_id": "z", "layer": 99, "first_block": 0}),
                b"\x01" * 64], [msgpack.packb([1, 2, 3])], [b""]]
    for frames in garbage:
        sock.send_multipart(frames)
    pipe, deadline = d.runner.connector.pipe, time.monotonic() + 30
    while pipe.stats()["dropped"] < len(garbage):  # every one read and rejected first
        assert time.monotonic() < deadline, pipe.stats()
        time.sleep(0.01)
    prompt = prompts_of_lengths([30])[0]
    submit_pair(p, d, "ok", prompt, GREEDY, d.kv_endpoint())
    got = run_in_process(p, d)
    assert got["ok"] == colocated_tokens(model, [prompt], [GREEDY], block_size=8)[0]
    assert d.stats()["kv_fallbacks"] == 0
    sock.close()
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


def test_engine_in_either_role_serves_ordinary_requests(model):
    prompts = prompts_of_lengths([12, 33])
    ref = colocated_tokens(model, prompts, [GREEDY, GREEDY])
    for role in ("consumer", "producer"):
        e = engine(model, role, block_size=8)
        for i, prompt in enumerate(prompts):
            e.add_request(f"plain{i}", prompt, GREEDY)
        got = {}
        while e.has_unfinished_requests():
            got.update({o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished})
        assert [got["plain0"], got["plain1"]] == ref
        e.check_no_leaks()
        e.close()


def test_consumer_abort_releases_producer_blocks_at_once(model):
    d = engine(model, "consumer", block_size=8)
    p = engine(model, "producer", timeout=30, block_size=8)
    prompt = prompts_of_lengths([40])[0]
    submit_pair(p, d, "gone", prompt, GREEDY, d.kv_endpoint())
    d.step()  # registered, waiting for KV
    d.abort_request(["gone"])  # e.g. the client disconnected
    start = time.monotonic()
    while p.has_unfinished_requests() or d.has_unfinished_requests():
        assert time.monotonic() - start < 10, "producer kept its blocks after the consumer abort"
        p.step(), d.step()
    assert p.stats()["kv_send_timeouts"] == 0  # freed by the consumer's NACK, not the timeout
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


@pytest.mark.parametrize("consumer_aborted", [False, True])
def test_answer_to_fin_before_its_send_returns_still_frees_at_once(model, consumer_aborted):
    """The consumer's ACK (or NACK after its abort) can be handled by the producer's receiver
    thread before send_tensor(FIN) has returned; the producer must still free its blocks at once.
    The producer's pipe is wrapped to force that interleaving."""
    d = engine(model, "consumer", block_size=8)
    p = engine(model, "producer", timeout=30, block_size=8)
    pipe = p.runner.connector.pipe
    send, recv = pipe.send_tensor, pipe.recv_tensor
    reading, answered = threading.Event(), threading.Event()
    last_kind: list[str | None] = [None]

    def recv_noting_answers(timeout):
        if last_kind[0] == "ack":  # the receiver thread is back for more: the answer is handled
            answered.set()
        reading.set()
        msg = recv(timeout=timeout)
        last_kind[0] = None if msg is None else msg[1].get("kind")
        return msg

    def send_fin_then_wait_for_answer(peer, header, tensor):
        future = send(peer, header, tensor)
        if header.get("kind") == "fin":
            assert answered.wait(10), "the consumer never answered the FIN"
        return future

    pipe.recv_tensor, pipe.send_tensor = recv_noting_answers, send_fin_then_wait_for_answer
    assert reading.wait(5)  # a receive begun before the wrapping could return the answer unseen
    submit_pair(p, d, "quick", prompts_of_lengths([40])[0], GREEDY, d.kv_endpoint())
    d.step()  # registered, waiting for KV
    if consumer_aborted:  # cancelled before any KV arrived: the FIN's NACK is the only answer
        d.abort_request(["quick"])
        d.step()
    start = time.monotonic()
    while p.has_unfinished_requests() or d.has_unfinished_requests():
        assert time.monotonic() - start < 10, "producer kept its blocks after the answer"
        p.step(), d.step()
    assert answered.is_set() and p.stats()["kv_send_timeouts"] == 0
    p.check_no_leaks(), d.check_no_leaks()
    p.close(), d.close()


def test_contiguous_runs():
    from connectors.block_io import contiguous_runs
    assert contiguous_runs((4, 5, 6)) == [(0, 3, 4, False)]
    assert contiguous_runs((9, 8, 7, 3, 4)) == [(0, 3, 7, True), (3, 2, 3, False)]
    assert contiguous_runs((2, 7, 1)) == [(0, 1, 2, False), (1, 1, 7, False), (2, 1, 1, False)]
    assert contiguous_runs(()) == []


@pytest.mark.parametrize("src_blocks", [(9, 8, 7, 3, 4), (0, 1, 2, 3, 4), (11, 2, 7, 5, 0, 9)])
def test_worker_pair_moves_blocks_exactly(src_blocks):
    """Zero-copy runs (ascending, descending) and the gathered fallback land bit-exactly."""
    from connectors.config import KVTransferConfig
    from connectors.metadata import FinishSpec, KVConnectorMetadata, RecvSpec, SendSpec
    from connectors.pd_connector import PDConnectorWorker
    info = {"model_id": "t", "dtype": "torch.float32", "block_size": 4, "num_layers": 2,
            "num_kv_heads": 2, "head_dim": 8}
    cons = PDConnectorWorker(KVTransferConfig(role="consumer", pipe="zmq"), info)
    prod = PDConnectorWorker(KVTransferConfig(role="producer", pipe="zmq"), info)
    src = [torch.randn(2, 12, 4, 2, 8) for _ in range(2)]
    dst = [torch.zeros(2, 12, 4, 2, 8) for _ in range(2)]
    prod.register_kv_caches(src), cons.register_kv_caches(dst)
    dst_blocks = (3, 10, 1, 6, 8, 2)[:len(src_blocks)]
    n_tokens = len(src_blocks) * 4 - 1
    cons.bind_connector_metadata(KVConnectorMetadata(recvs=[RecvSpec("w", dst_blocks, n_tokens)]))
    peer = cons.endpoint()
    prod.connect_peer(peer)  # at launch in a cluster: never on the forward path
    prod.bind_connector_metadata(KVConnectorMetadata(sends=[SendSpec("w", peer, src_blocks, 0)]))
    for layer in range(2):
        prod.save_kv_layer(layer, src[layer], None)
    prod.wait_for_save()
    prod.bind_connector_metadata(KVConnectorMetadata(finishes=[FinishSpec("w", peer, 7, n_tokens)]))
    deadline, received = time.monotonic() + 10, {}
    while "w" not in received:
        assert time.monotonic() < deadline
        prod.bind_connector_metadata(KVConnectorMetadata())  # steps send deferred layers
        received.update(cons.get_finished()[1])
        time.sleep(0.005)
    assert received["w"] == 7
    for layer in range(2):
        assert torch.equal(dst[layer][:, list(dst_blocks)], src[layer][:, list(src_blocks)])
    prod.close(), cons.close()


def test_long_runs_are_split_into_single_frame_messages():
    from connectors.config import KVTransferConfig
    from connectors.metadata import FinishSpec, KVConnectorMetadata, RecvSpec, SendSpec
    from connectors.pd_connector import PDConnectorWorker
    info = {"model_id": "t", "dtype": "torch.float32", "block_size": 4, "num_layers": 1,
            "num_kv_heads": 2, "head_dim": 8}  # 256 bytes per block and part
    cfg = KVTransferConfig.from_dict({"role": "both", "pipe": "zmq",
                                      "max_frame_bytes": 1024})  # 4 blocks
    worker = PDConnectorWorker(cfg, info)
    src, dst = torch.randn(2, 40, 4, 2, 8), torch.zeros(2, 40, 4, 2, 8)
    worker.register_kv_caches([src])
    worker.receiver.kv_caches = [dst]  # same engine as both roles: receive into another cache
    src_blocks, dst_blocks = tuple(range(17, 6, -1)), tuple(range(25, 36))  # descending, 11
    worker.bind_connector_metadata(KVConnectorMetadata(recvs=[RecvSpec("s", dst_blocks, 44)]))
    worker.connect_peer(worker.endpoint())
    meta = KVConnectorMetadata(sends=[SendSpec("s", worker.endpoint(), src_blocks, 0)])
    worker.bind_connector_metadata(meta)
    messages = worker.sender.layer_messages(meta.sends[0], 0, src)
    assert len(messages) == 6  # 3 messages each for K and V
    worker.save_kv_layer(0, src, None)
    worker.wait_for_save()
    worker.bind_connector_metadata(KVConnectorMetadata(
        finishes=[FinishSpec("s", worker.endpoint(), 1, 44)]))
    deadline, got = time.monotonic() + 10, {}
    while "s" not in got:
        assert time.monotonic() < deadline
        worker.bind_connector_metadata(KVConnectorMetadata())  # steps send deferred layers
        got.update(worker.get_finished()[1])
        time.sleep(0.005)
    assert torch.equal(dst[:, list(dst_blocks)], src[:, list(src_blocks)])
    worker.close()


@pytest.mark.parametrize("parts,first", [(2, 0), (1, 0), (2, 3)])
def test_gathered_blocks_go_as_single_frame_messages(parts: int, first: int):
    """Scattered source blocks (gathered into a buffer): each message at most one frame, so
    the receiver never joins frames with a copy; the blocks still land exactly, for K and V
    (full attention), one latent part (MLA), and blocks from a later table index (a
    sliding layer's window or a later chunk: the consumer holds the first ones)."""
    from connectors.config import KVTransferConfig
    from connectors.metadata import FinishSpec, KVConnectorMetadata, RecvSpec, SendSpec
    from connectors.pd_connector import PDConnectorWorker
    info = {"model_id": "t", "dtype": "torch.float32", "block_size": 4, "num_layers": 1,
            "num_kv_heads": 2, "head_dim": 8}  # 256 bytes per block and part
    frame = 512 * parts  # two blocks of every part
    worker = PDConnectorWorker(KVTransferConfig.from_dict(
        {"role": "both", "pipe": "zmq", "max_frame_bytes": frame}), info)
    src, dst = torch.randn(parts, 40, 4, 2, 8), torch.zeros(parts, 40, 4, 2, 8)
    worker.register_kv_caches([src])
    worker.receiver.kv_caches = [dst]
    src_blocks = (3, 9, 1, 30, 7, 22, 5)  # 7 runs: gathered
    dst_blocks = tuple(range(10, 10 + first)) + tuple(range(25, 32))
    n_tokens = 4 * len(dst_blocks)
    worker.bind_connector_metadata(KVConnectorMetadata(
        recvs=[RecvSpec("g", dst_blocks, n_tokens, num_cached_tokens=4 * first)]))
    worker.connect_peer(worker.endpoint())
    meta = KVConnectorMetadata(sends=[SendSpec("g", worker.endpoint(), src_blocks, first)])
    worker.bind_connector_metadata(meta)
    messages = worker.sender.layer_messages(meta.sends[0], 0, src)
    assert [m.tensor.nbytes for m in messages] == [frame] * 3 + [frame // 2]
    assert [m.header.first_block for m in messages] == [first, first + 2, first + 4, first + 6]
    worker.save_kv_layer(0, src, None)
    worker.wait_for_save()
    worker.bind_connector_metadata(KVConnectorMetadata(
        finishes=[FinishSpec("g", worker.endpoint(), 1, n_tokens)]))
    deadline, got = time.monotonic() + 10, {}
    while "g" not in got:
        assert time.monotonic() < deadline
        worker.bind_connector_metadata(KVConnectorMetadata())  # steps send deferred layers
        got.update(worker.get_finished()[1])
        time.sleep(0.005)
    assert got["g"] == 1
    assert torch.equal(dst[:, list(dst_blocks[first:])], src[:, list(src_blocks)])
    assert not dst[:, list(dst_blocks[:first])].any()  # held here: never written
    worker.close()
