"""The engine driver shared by every host of an LLMEngine (the Ray engine actor in
pd_cluster.serving, the stand-alone engine process in pd_cluster.engine): the thread that owns
the engine (EngineLoop) and the typed messages it speaks. It imports nothing from serving/."""
