"""The environment the tests' real vLLM servers (vLLM's CPU build) run with, beyond what
`gspo rollout-server` sets itself.

- The model worker in the engine-core process, where vLLM keeps it on one GPU
  (tensorParallelSize 1) and `gspo train` on one core: the CPU platform's own layout spawns it
  a process of its own (one more import of vLLM and torch at each start), which spins on its
  message queue for a second after every request it reads (shm_broadcast.SpinCondition), a
  core the other workers' tests wait for.
- One OpenMP thread. With the worker in the engine nothing binds its threads, so torch runs a
  team of one per core, and a team's threads spin at every barrier waiting for the others:
  on the tiny models, with two busy loops beside it, 150 steps of 8 requests took 23.6 CPU s
  and 19.2 s with the machine's two threads against 4.7 CPU s and 3.9 s with one (idle: 8.7
  against 3.8 CPU s, 5.1 against 3.6 s).
"""

SERVER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
