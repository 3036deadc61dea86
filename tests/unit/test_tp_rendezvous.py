"""A tensor-parallel group's rendezvous (rank 0's key-value store, `llm_service.model.tensor_parallel.
rendezvous_store`) listens on the group's address alone: torch's own server listened on every interface
(`[::]:PORT`, no authentication) whatever the address said (issue 59). Two ranks in processes of their
own, gloo on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RANK = """
import json, sys, psutil, torch
from llm_service.model.tensor_parallel import TPGroup
group = TPGroup(int(sys.argv[1]), 2, sys.argv[2], torch.device("cpu"), timeout_s=60)
x = torch.ones(2)
group.all_reduce(x)  # both ranks joined: rank 0's store still listens
listening = [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN]
group.all_reduce(torch.ones(1))  # neither rank leaves before the other has looked
print(json.dumps({"sum": x.tolist(), "listening": listening}), flush=True)
import os; os._exit(0)  # no C++ teardown racing gloo's threads ("terminate called without an active exception")
"""


def test_the_rendezvous_store_listens_on_the_groups_address_only():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), init], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    said = []
    for rank in ranks:
        out, err = rank.communicate(timeout=120)
        assert rank.returncode == 0, err[-3000:]
        said.append(json.loads(out.strip().splitlines()[-1]))
    assert [s["sum"] for s in said] == [[2.0, 2.0]] * 2
    assert said[0]["listening"], "rank 0 listens for the store"
    assert [ip for s in said for ip in s["listening"] if ip not in ("127.0.0.1", "::1")] == []
