"""Bridges from verispec's drafters to other serving systems, one module per system.

- `vllm`: `AnpdProposer`, ANPD drafting inside vLLM through its custom proposer hook
  (`speculative_config={"method": "custom_class", "model": "verispec.integrations.vllm.AnpdProposer"}`).

Nothing here is imported by `import verispec`, and no module here imports the system it bridges
to: each is duck-typed against the interface that system calls, so it installs into that
system's environment without verispec's own dependencies (see docs/vllm.md).
"""
