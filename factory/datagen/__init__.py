"""The datagen run's plain parts: its config, endpoints, task runners, backpressure, bookkeeping and summary.

flows/datagen.py is the data path (plan -> generate -> score -> group -> commit) over these; nothing here
imports flows/, so the flow, its CLI and tests import downward only.
"""
