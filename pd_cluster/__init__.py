"""pd-cluster: prefill/decode disaggregated LLM serving."""
from pd_cluster.llm import LLM
from pd_cluster.outputs import CompletionOutput, RequestOutput
from pd_cluster.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
