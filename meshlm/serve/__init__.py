"""The serving wing, in the shape of vLLM v1's engine: the engine (`engine`) on top; the scheduler
(`scheduler`: requests, the queue, the slots and the KV pages) and the runner (`runner`: the compiled
programs and the device state) side by side below it; under them a host-only contract (`batch`: what a
step runs and what it produced; `params`: `SamplingParams`; `outputs`: a row's output as it arrives) with
`pages`, `adapter_slots` and `grammar`; `config` holds the engine's settings (`EngineConfig`). The device
sampler (`sampler`) runs inside the runner's programs.

Only `runner`, `sampler` and `engine` import jax: the rest runs on any host, without a device. Importing
the package imports nothing."""
