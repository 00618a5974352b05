"""Does a Faust changelog-backed table recover after kill -9 on this broker, and exactly once?

A timeboxed check behind the decision in streams/app.py (not a test: it prints what it saw).
Creates a topic `tc<pid>.in` on ADSTREAM_KAFKA__BOOTSTRAP (default 127.0.0.1:9092), produces
20,000 records over 200 keys, runs a Faust worker counting them in a table, kills it with -9
at ~3,000, restarts it and prints the table total after recovery (20,000 = exactly once).
"""

import asyncio
import os
import signal
import subprocess
import sys
import time

P = os.environ.get("TC_PREFIX", f"tc{os.getpid()}.")
N = 20000
BOOT = os.environ.get("ADSTREAM_KAFKA__BOOTSTRAP", "127.0.0.1:9092")
LOGS = os.environ.get("TC_LOGS", "/tmp")
if len(sys.argv) > 1 and sys.argv[1] == "worker":
    import faust

    app = faust.App(
        f"{P}tcapp",
        broker=f"kafka://{BOOT}",
        store="memory://",
        web_enabled=False,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=10,
        broker_heartbeat_interval=1,
        datadir=f"{LOGS}/{P}data",
        topic_partitions=4,
    )
    topic = app.topic(f"{P}in", value_serializer="raw", key_serializer="raw", partitions=4)
    table = app.Table("counts", default=int, partitions=4)

    @app.agent(topic)
    async def count(stream):
        async for key, _ in stream.items():
            table[key.decode()] += 1

    @app.timer(0.5)
    async def report():
        print(f"TOTAL {sum(table.values())}", flush=True)

    sys.argv = [sys.argv[0], "worker", "-l", "info"]
    app.main()
else:
    from aiokafka import AIOKafkaProducer

    async def produce():
        pr = AIOKafkaProducer(bootstrap_servers=BOOT, linger_ms=5)
        await pr.start()
        futs = [await pr.send(f"{P}in", value=b"x", key=b"k%d" % (i % 200)) for i in range(N)]
        await asyncio.gather(*futs)
        await pr.stop()

    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    async def mk():
        a = AIOKafkaAdminClient(bootstrap_servers=BOOT)
        await a.start()
        await a.create_topics([NewTopic(f"{P}in", 4, 1)])
        await a.close()

    asyncio.run(mk())
    asyncio.run(produce())
    env = dict(os.environ, TC_PREFIX=P)

    def start(log):
        return subprocess.Popen(
            [sys.executable, __file__, "worker"], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT
        )

    def last_total(log):
        import re

        t = re.findall(r"TOTAL (\d+)", open(log, errors="replace").read())
        return int(t[-1]) if t else None

    w = start(f"{LOGS}/tc1.log")
    t0 = time.time()
    while time.time() - t0 < 60:
        v = last_total(f"{LOGS}/tc1.log")
        if v and v > 3000:
            break
        time.sleep(0.3)
    # slow the kill until mid-stream: the count is fast, so kill as soon as it is partly done
    os.kill(w.pid, signal.SIGKILL)
    w.wait()
    print("killed at", last_total(f"{LOGS}/tc1.log"), flush=True)
    w2 = start(f"{LOGS}/tc2.log")
    t1 = time.time()
    res = None
    while time.time() - t1 < 150:
        v = last_total(f"{LOGS}/tc2.log")
        if v is not None and v >= N:
            res = v
            break
        time.sleep(1)
    print(
        "after restart:",
        last_total(f"{LOGS}/tc2.log"),
        "expected >=",
        N,
        "in",
        round(time.time() - t1, 1),
        "s",
        flush=True,
    )
    os.kill(w2.pid, signal.SIGKILL)
    os.system(f"grep -E 'No event received|Recovery|recovery' {LOGS}/tc2.log | tail -8")
