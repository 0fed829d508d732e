"""The engine core's room: what runs in the core process (or in process for the offline LLM).

core_proc.py           the core process: builds an EngineCore, serves its frontend over the one channel
transport.py           that channel: a pipe each way, length-prefixed frames of a Kind (outputs, heartbeats...)
engine_core.py         EngineCore: add / abort / step over the scheduler and the model runner
scheduler.py           continuous batching: admission, chunked prefill, preemption, spec-decode slots
scheduling_policy.py   the waiting queue's order (FCFS, priority, fair) and the preemption victim
sequence.py            one sequence's tokens, blocks and stop rule
kv_cache.py            the paged KV block manager and its prefix cache
kv_budget.py           how many KV blocks fit the device (device_memory.py reads the allocator)
decode_loop.py         the multi-step device loop's scheduling; loop_stream.py / pipe_tap.py stream it
sampler.py             the jitted sampler; structured_output.py the grammar masks
step_data.py           SchedulerOutput and StepResult, a step as plain host data
runner/                the model runner: inputs, device step, warm-up, weight sync
spec_decode/           speculative decoding: n-gram, draft model and EAGLE proposers, verification
pooling/               --runner pooling: embeddings and cross-encoder scores (pooler, runner, scoring)
"""
