"""The engine section's ``faults``: test-only fault injection, off unless a test or a ``--set``
key turns it on (``--set engine.faults.kv_send.drop=0.05``), never in a release default.

A share of the operations at each site is dropped, delayed, corrupted or failed, so tests can
show that every completed output stays exact under them (recompute, retry or migration),
that no engine dies and nothing is held afterwards. Each kind with a rate rolls its own RNG,
seeded from ``seed``, the site and the kind, once per operation: a run's faults depend only
on the sequence of operations, never on timing. Each injected fault is counted in the
engine's stats as ``faults_injected_<site>_<kind>`` (pd_cluster/fault_sites.py).

What each kind means at each site:

- ``kv_send``: every message this engine's KV pipe sends (layers, the P/D protocol's OFFER,
  HOLD, FIN, ACK and RENEW, write notifications) and every write into a decode engine's
  blocks (pipes that write in place). ``drop``: it never leaves (its future resolves as if
  sent): a lost layer fails its transfer closed at the FIN and the decode engine recomputes;
  a lost FIN ends in the decode engine's ``kv_transfer_timeout``, a lost HOLD in the
  producer's wait for it (or, written in place, a write without a grant: recomputed), a
  lost ACK in the producer's lease. ``fail``: the send's future holds a PipeError (nothing
  left): a producer fails that transfer (its FIN says recompute) and drops the link, which
  the cluster links again; a consumer's answer is lost as if dropped. ``delay``: it leaves
  after ``delay_s`` (the sending thread waits). ``corrupt``: a bit of the message
  (its payload, else its header) flips after its integrity code was computed, so the code
  vouches for other bytes than those on the wire: the receiver's check must refuse it (fail
  closed, recompute). Needs ``kv_transfer.integrity`` mac or crc32, and a pipe with an
  integrity channel (zmq, shm, auto; not gloo or nccl).
- ``kv_recv``: every message the KV pipe receives, and every write a producer made into this
  engine's blocks. ``drop``: lost before the connector sees it; ``fail``: the receive raises
  a PipeError and its message is lost; ``delay``: handed over after ``delay_s``;
  ``corrupt``: a bit of what arrived flips before the integrity check (a message's payload,
  else its header; a write's blocks, checked by the write's MAC), which must refuse it.
- ``token``: the frames of the engine's token path to the proxy (one per engine step and
  proxy session). ``drop``: the frame is not written: the proxy finds the gap at the
  request's next delta and the leg fails (retried or migrated); a request's last frame lost
  ends that request at its deadline with a timeout error. ``corrupt``: a bit of the frame's
  payload flips after its CRC-32 was computed: the proxy refuses the frame as malformed and
  the link fails like a lost one (its legs migrate). ``fail``: the write fails as a broken
  connection: the engine closes the session and aborts its requests, the proxy's legs on it
  retry or migrate. ``delay``: the frame is written after ``delay_s`` (the engine thread
  waits).
- ``control``: the engine's control calls (those run on its engine thread between steps:
  the cluster's cache reports, leak checks, role switches). ``fail``: the call raises
  InjectedFault instead of running; ``delay``: it runs after ``delay_s`` (the engine thread
  waits). ``drop`` and ``corrupt`` do not apply to calls.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

FAULT_KINDS = ("drop", "delay", "corrupt", "fail")
FAULT_SITES = ("kv_send", "kv_recv", "token", "control")


class SiteFaults(BaseModel):
    """The share of one site's operations each kind of fault hits (see pd_cluster/faults.py)."""
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    drop: float = 0.0  # test-only (pd_cluster/faults.py): share of the site's operations lost
    delay: float = 0.0  # test-only: share of the site's operations held back faults.delay_s
    corrupt: float = 0.0  # test-only: share of the site's operations with one bit flipped
    fail: float = 0.0  # test-only: share of the site's operations failed with an error

    @field_validator("drop", "delay", "corrupt", "fail")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError(f"must be a fraction in [0, 1], got {value}")
        return value

    @property
    def active(self) -> bool:
        return any(getattr(self, kind) for kind in FAULT_KINDS)


class FaultsConfig(BaseModel):
    """Test-only fault injection (pd_cluster/faults.py says what each site and kind means);
    unset: off."""
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    kv_send: SiteFaults = SiteFaults()  # messages and writes the KV pipe sends
    kv_recv: SiteFaults = SiteFaults()  # messages and writes the KV pipe receives
    token: SiteFaults = SiteFaults()  # frames of the token path to the proxy
    control: SiteFaults = SiteFaults()  # control calls on the engine thread (fail, delay)
    delay_s: float = 0.05  # test-only: how long a delayed operation is held back, s
    seed: int = 0  # test-only: seeds every site's fault RNGs (reproducible runs)

    @field_validator("delay_s")
    @classmethod
    def _delay(cls, value: float) -> float:
        if not 0 <= value <= 60:
            raise ValueError(f"must be in [0, 60] s, got {value}")
        return value

    @model_validator(mode="after")
    def _calls_fail_or_wait(self) -> "FaultsConfig":
        for kind in ("drop", "corrupt"):
            if getattr(self.control, kind):
                raise ValueError(f"control.{kind}: control calls are failed or delayed "
                                 f"only (drop and corrupt apply to the other sites)")
        return self

    def site(self, name: str) -> SiteFaults:
        return getattr(self, name)
