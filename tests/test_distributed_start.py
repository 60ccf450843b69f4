"""Starting on a TPU host (or any lone machine): no cluster is joined unless something explicitly describes
more than one process, a failed join says in one line what it tried, and the demos' tokenizer follows the
one resolution path (`$MESHLM_TOKENIZER` first) without touching the network."""

import base64

import jax
import pytest

from meshlm import demo_corpus, distributed, tokenizer
from meshlm.config import ConfigError

CLUSTER_VARS = (
    "MESHLM_COORDINATOR",
    "MESHLM_NUM_PROCESSES",
    "MESHLM_PROCESS_ID",
    "MESHLM_CLUSTER",
    "JAX_COORDINATOR_ADDRESS",
    *distributed.SLURM_VARS,
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_COMM_WORLD_SIZE",
    "TPU_PROCESS_ADDRESSES",
    "TPU_WORKER_HOSTNAMES",
)
# What a one-host TPU VM's environment carries (values as a v5e-1 sets them): nothing that says "cluster".
TPU_VM = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-1",
    "TPU_WORKER_ID": "0",
    "TPU_SKIP_MDS_QUERY": "",
    "TPU_CHIPS_PER_HOST_BOUNDS": "1,1,1",
}


@pytest.fixture
def joins(monkeypatch):
    """The calls `jax.distributed.initialize` gets, in an environment without any cluster variable."""
    for var in CLUSTER_VARS:
        monkeypatch.delenv(var, raising=False)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kwargs: calls.append((args, kwargs)))
    return calls


def test_a_one_host_tpu_vm_joins_no_cluster(joins, monkeypatch):
    for key, value in TPU_VM.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")  # one host listed: one process
    assert distributed.environment_cluster() is None
    distributed.initialize()
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a SLURM job of one task is one process too
    for var in distributed.SLURM_VARS:
        monkeypatch.setenv(var, "1" if var == "SLURM_NTASKS" else "0")
    distributed.initialize()
    distributed.initialize("127.0.0.1:1234", 1, 0)  # explicitly one process
    assert joins == []


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"TPU_WORKER_HOSTNAMES": "host-0,host-1,host-2,host-3"}, "GkeTpuCluster"),
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "2"}, "OmpiCluster"),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "JAX_COORDINATOR_ADDRESS"),
        ({"MESHLM_CLUSTER": "jax"}, "JAX's own detection"),
    ],
)
def test_a_cluster_the_environment_describes_is_joined(joins, monkeypatch, env, name):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert distributed.detected_cluster() == name
    distributed.initialize(heartbeat_timeout_s=5)
    assert joins == [((), {"heartbeat_timeout_seconds": 5})]


def test_a_failed_join_names_what_it_tried_in_one_line(monkeypatch):
    for var in CLUSTER_VARS:
        monkeypatch.delenv(var, raising=False)

    def refuse(*args, **kwargs):
        raise RuntimeError("HTTPConnectionPool(host='metadata.google.internal', port=80):\nMax retries exceeded")

    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-0,host-1")
    with pytest.raises(ConfigError) as error:
        distributed.initialize()
    message = str(error.value)
    assert "\n" not in message
    assert "GkeTpuCluster, 2 processes, from TPU_WORKER_HOSTNAMES lists 2 hosts" in message
    assert "HTTPConnectionPool" in message
    with pytest.raises(ConfigError, match=r"coordinator 10\.0\.0\.1:1234, process 1 of 2"):
        distributed.initialize("10.0.0.1:1234", 2, 1)


def test_the_demos_tokenizer_takes_meshlm_tokenizer_first_and_never_the_network(tmp_path, monkeypatch):
    """With $MESHLM_TOKENIZER set and no cache, the demos load that file; PyPI is never asked."""
    bpe = tmp_path / "bytes.tiktoken"  # a BPE of the 256 single bytes: enough to encode ASCII
    bpe.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    monkeypatch.setenv("MESHLM_TOKENIZER", str(bpe))
    monkeypatch.setattr(tokenizer, "CACHE_FILE", tmp_path / "no-cache" / "r50k_base.tiktoken")

    def no_network(*args, **kwargs):
        raise AssertionError("the demos asked PyPI for a tokenizer")

    monkeypatch.setattr(demo_corpus, "fetch_from_pypi", no_network)
    tok = demo_corpus.gpt2_tokenizer()
    assert tok.encode("ab") == [ord("a"), ord("b")]
    monkeypatch.delenv("MESHLM_TOKENIZER")
    with pytest.raises(AssertionError, match="asked PyPI"):  # neither the variable nor the cache: the download
        demo_corpus.gpt2_tokenizer()
