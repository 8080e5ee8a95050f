"""A request's KV transfer is done only when every rank says so (each rank ships its own heads).

Ranks report finished sends and receives step by step, not necessarily in the same step; the
tally holds partial reports and releases a request once all ``size`` ranks reported it. A
receive that failed on any rank (first token None) failed for the engine: the consumer then
prefills the prompt itself. A failed or cancelled receive's blocks stay fenced until every rank
said no producer can still write into its share of them.
"""
from __future__ import annotations

from pd_cluster.engine.tp_comm import RankTransfers


class TransferTally:
    def __init__(self, size: int) -> None:
        self.size = size
        self._sent: dict[str, set[int]] = {}
        self._recvd: dict[str, dict[int, int | None]] = {}
        self._unfenced: dict[str, set[int]] = {}

    def add(self, reports: list[RankTransfers]
            ) -> tuple[set[str], dict[str, int | None], set[str]]:
        """Fold one step's per-rank reports in; return what every rank has now reported
        (sends done, receives done, receives unfenced)."""
        done_sending: set[str] = set()
        done_recving: dict[str, int | None] = {}
        unfenced: set[str] = set()
        for rank, report in enumerate(reports):
            _count(self._sent, report.sending, rank, self.size, done_sending)
            _count(self._unfenced, report.unfenced, rank, self.size, unfenced)
            for rid, first in report.recving.items():
                got = self._recvd.setdefault(rid, {})
                got[rank] = first
                if len(got) == self.size:
                    firsts = list(got.values())
                    done_recving[rid] = None if None in firsts else firsts[0]
                    del self._recvd[rid]
        return done_sending, done_recving, unfenced

    @property
    def pending(self) -> int:
        return len(self._sent) + len(self._recvd)


def _count(partial: dict[str, set[int]], rids: list[str], rank: int, size: int,
           complete: set[str]) -> None:
    """Note ``rank`` reported each of ``rids``; those every rank reported go to ``complete``."""
    for rid in rids:
        ranks = partial.setdefault(rid, set())
        ranks.add(rank)
        if len(ranks) == size:
            complete.add(rid)
            del partial[rid]
