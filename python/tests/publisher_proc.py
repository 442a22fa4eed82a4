"""A trainer rank as its own process, for the cross-process tests: it registers its arrays,
publishes step 1, prints "published 1", then obeys stdin: "advance N" rewrites the arrays for
step N and publishes it (printing "published N"); "exit" withdraws and exits.

usage: publisher_proc.py ETCD_URL MODEL_JSON TOPOLOGY RANK TRANSPORT
"""

import json
import sys

import reshard
from weights import fill, trainer_arrays


def main():
    url, model, topology, rank, transport = sys.argv[1:6]
    model = json.loads(model)
    with reshard.Publisher(model=model["name"], architecture=model, topology=topology,
                           rank=int(rank), rendezvous=url,
                           transport=transport, lease_ttl=10.0) as pub:
        arrays = trainer_arrays(pub.tensors, 1)
        for name, array in arrays.items():
            pub.register(name, array)
        pub.publish(1)
        print("published 1", flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if cmd[:1] == ["advance"]:
                step = int(cmd[1])
                pub.unready()
                fill(arrays, pub.tensors, step)
                pub.publish(step)
                print(f"published {step}", flush=True)
            elif cmd[:1] == ["exit"]:
                break


if __name__ == "__main__":
    main()
