"""The rank pool tests use: ``toolkit.runtime.rankpool`` (production code starts ranks with it
too: ``mdtk convert --to trainer``), re-exported here for the tests and benchmark scripts."""

from toolkit.runtime.rankpool import RankFailure, RankPool

__all__ = ["RankFailure", "RankPool"]
