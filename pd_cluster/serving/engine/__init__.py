"""The engine side of the cluster: an LLMEngine hosted in a Ray actor (driven by
pd_cluster.driver's EngineLoop, as the stand-alone engine process is)."""
