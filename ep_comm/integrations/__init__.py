"""Adapters that plug ep_comm into inference engines.

Each engine's adapter lives in its own module and imports that engine; nothing here is imported by
``import ep_comm``, so the core package never depends on an engine.

- ``ep_comm.integrations.vllm``: ``EPCommPrepareAndFinalize``, vLLM's modular-kernel prepare/finalize
  over any ``ep_comm.Communicator`` (docs/vllm.md).
- ``ep_comm.integrations.vllm_plugin``: the ``vllm.general_plugins`` entry point that makes a vLLM
  engine build its MoE layers on ep_comm (opt-in with ``EP_COMM_VLLM=1``).
"""
