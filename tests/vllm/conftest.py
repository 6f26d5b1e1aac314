"""The vLLM suite's TP workers start from a preloaded server (worker_processes: why, and what still spawns)."""

import worker_processes

worker_processes.install()
