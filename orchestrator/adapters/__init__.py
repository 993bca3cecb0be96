"""The driver's clients of the actors: each presents an actor as the Protocol a loop declares.

Modules:
  clients.py   TrainerClient (Trainer: a train order to the TrainerGroup), BufferStore (SampleStore:
               clears by the keys rollout results carry), DriverBytes + MeteredRollouts (what the driver
               receives, metered at its Ray and TransferQueue clients), GatewayProbe,
               EngineLoads
  colocate.py  SleepingTrainer: cluster=colocated, the engines sleep while the trainer updates
"""
