"""The nemesis: real workers and Redis under seeded faults, and a checker of what clients saw.

In the spirit of Jepsen/Elle, FoundationDB's simulation and TigerBeetle's VOPR, adapted to
real processes: ``./dev nemesis --seed N --minutes M --topology single|sentinel|cluster``
(docs/nemesis.md). The modules:

* ``topology``: the processes: Redis (one server under libfaketime, a Sentinel set or a
  Cluster with replicas), ``ssmserve-server`` workers (``tests/worker_process.py``) and
  the TCP proxies (``tests/tcp_proxy.py``) in front of each worker and, with one Redis,
  between each worker and Redis.
* ``faults``: the scheduler, driven by ``random.Random(seed)``: kill -9 and SIGSTOP of
  workers and Redis nodes, black holes and slow links, Redis restarts (with and without
  data), clock steps, failovers, CPU hogs; each repaired by the call that injects it.
* ``clients``: the workloads through the real client library: streams with each
  durability, generation, rollbacks, snapshots, forecasts, forks, reads, migrations and
  drains, each request bounded and recorded.
* ``history``: the records (requests, faults, token sightings), dumped as JSON.
* ``fencing``: tokens from the workers' JSON logs and from Redis's meta hashes.
* ``checker``: the rules (durability, one owner, no repeated token, every request ended,
  recovery) and the stretch of history that shows a violation.
* ``run``: one run from start to verdict; ``__main__``: the command line.
"""
