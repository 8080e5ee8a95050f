"""tensor_parallel_size in the cluster YAML's role sections: it reaches each engine of the
role, multiplies the role's per-rank resources, and misplaced or impossible values are
one-line errors naming the key."""
from __future__ import annotations

import pytest

from pd_cluster.serving.cluster.cluster_config import ConfigError, parse_config


def test_role_tensor_parallel_size_reaches_its_engines_and_resources() -> None:
    cfg = parse_config({"prefill": {"tensor_parallel_size": 2, "num_cpus": 1, "num_gpus": 1},
                        "decode": {"replicas": 2, "num_cpus": 2}, "engine": {"device": "cpu"}})
    specs = {s.name: s for s in cfg.engine_specs()}
    assert specs["prefill-0"].engine_args["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in specs["decode-0"].engine_args
    assert cfg.prefill.demand() == {"CPU": 2.0, "GPU": 2.0}  # per rank x ranks
    assert cfg.required_cpus() == 2 + 2 * 2 and cfg.required_gpus() == 2
    colocated = parse_config({"mode": "colocated", "colocated": {"tensor_parallel_size": 4}})
    assert all(s.engine_args["tensor_parallel_size"] == 4 for s in colocated.engine_specs())


@pytest.mark.parametrize("data, want", [
    ({"engine": {"tensor_parallel_size": 2}}, "engine.tensor_parallel_size: set it per role"),
    ({"decode": {"tensor_parallel_size": 0}}, "decode.tensor_parallel_size: must be >= 1"),
    ({"prefill": {"tensor_parallel_size": 2, "num_gpus": 0.5}},
     "prefill.num_gpus: 0.5 with tensor_parallel_size 2: each rank needs a whole GPU"),
])
def test_misplaced_or_impossible_tensor_parallel_size_is_a_one_line_error(data, want) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value).startswith(want) and "\n" not in str(info.value)
