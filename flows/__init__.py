"""Prefect flows. Importing any of them (a worker's flow-run process does, to load the flow) makes a user error
end its flow run with one log line instead of Prefect's tracebacks (factory/cli_errors.py)."""

from factory.cli_errors import quiet_user_errors_in_flow_runs

quiet_user_errors_in_flow_runs()
