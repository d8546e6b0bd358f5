"""`conveyor bench`: a serving benchmark modelled on `vllm bench serve`.

datasets.py   seeded prompts (random token ids, shared prefixes) and Poisson arrivals
metrics.py    per-request timings -> throughput, TTFT / TPOT / ITL / E2EL summary
driver.py     sends the requests over the Generation API (asyncio), with a progress bar
stats.py      the scheduler's side: bubble per stage, prefix-cache hits, preemptions
report.py     the result table
compare.py    `--compare`: sync vs async vs one stage vs transformers, on this machine
stack.py      starts and stops one `conveyor up` stack for the comparison
hf_baseline.py  Hugging Face transformers static batching, the peer baseline
plot.py       each stage's busy and idle time from the Chrome trace, as a PNG
cli.py        the command line
"""
