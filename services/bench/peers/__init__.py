"""The serving engines a user would pick instead of Conveyor on a CPU, run by `conveyor bench
--compare --peers vllm,openvino` on the same workload (issue 15).

Each peer lives in its own virtualenv under a cache directory (`peers_dir()`), built on first
use (`venv.py`): vLLM's CPU build served as users serve it (`vllm.py`), and OpenVINO GenAI's
in-process continuous-batching pipeline (`openvino.py`, `ov_runner.py`).
"""
