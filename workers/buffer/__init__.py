"""The trajectory buffer: finished rollouts held in TransferQueue until the loop trains on them.

Modules:
  codec.py  pure encode/decode between `Sample` and TransferQueue rows
  store.py  TrajectoryBuffer: TransferQueue's controller and storage, put / get whole groups / clear
"""
