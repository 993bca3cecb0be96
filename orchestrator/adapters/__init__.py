"""The driver's clients of the actors: each presents an actor as the Protocol a loop declares.

Modules:
  clients.py   TrainerClient (Trainer: a train order to the TrainerGroup), BufferStore (SampleStore:
               metadata only), DriverBytes + MeteredRollouts (what the driver receives), GatewayProbe,
               EngineLoads
  colocate.py  SleepingTrainer: cluster=colocated, the engines sleep while the trainer updates
"""
