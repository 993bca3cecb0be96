"""Trainer -> inference weight transfer, versioned: one safetensors file, or a bucketed broadcast.

Modules:
  protocol.py   WeightSync, the one protocol every backend follows (version, sync, lost, metrics),
                and ReplaceableWeightSync (admit) of the file backends
  lora.py       PEFT file names and how many LoRA versions a replica serves (no torch)
  parts.py      the typed adapters of the trainer and the replicas as the weight sync calls them
  file.py       FileWeightSync: the trainer writes one safetensors file, every replica reloads it
  plan.py       bucket planner of the broadcast (pure)
  transport.py  byte movers of the broadcast: /dev/shm, CUDA IPC, gloo, NCCL
  broadcast.py  the sender and receiver of a versioned, bucketed broadcast
  receiver.py   a receiver that loads into plain torch tensors, and its process entry point
  setup.py      the run's weight sync, chosen by `trainer.weight_sync.backend`, opened and closed once
  rendezvous.py TCPStores on a port the OS picked and kept bound (weight-sync groups, trainer ranks)
  adapter.py    the LoRA adapter sync: each sync sends the adapter only, the replicas load it by version
  probe.py      proof of arrival: every engine scores a probe sequence after each sync
"""
