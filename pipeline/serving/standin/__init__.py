"""The stand-in replica: a local CPU HTTP server, not vLLM, that speaks a vLLM replica's routes.

It decodes speculatively with this project's own code (`engine.py`, its /v1/completions in `completions.py`,
the server in `replica.py`) and serves vLLM's endpoints, metric names and weight-update routes, so the fleet's
request path drives it as it drives vLLM. It exists because vLLM cannot serve the toy target here: the toy
target's attention heads are 8 wide and vLLM's CPU attention starts at 32, so the toy demo's fleet
(`fleet.driver: standin`) runs stand-ins (`make demo FLEET=vllm` reshapes the target to one 32-wide head and serves
it with vLLM, configs/vllm.yaml). It also serves the tests as a replica they can break: its own
routes count its requests and inject faults (a `/update_weights` that fails part way).

The real fleet's path (`pipeline/serving/`) does not import it; the `standin` driver starts it as a process
(`python -m pipeline.serving.standin.replica`).
"""
