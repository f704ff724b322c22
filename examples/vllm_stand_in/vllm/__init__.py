"""A stand-in for the few names of vLLM that ep_comm.integrations.vllm imports, for machines without vLLM
(ep_comm's GPU tests and examples/vllm_adapter_overhead.py).  It only lets the adapter be imported and
driven the way vLLM's modular kernel drives it; it is not vLLM and computes nothing.  Never on the path
when a real vLLM imports (see ../__init__.py)."""
__version__ = "0.0.0+ep_comm.stand_in"
