"""The fleet planner: a pure decision core, observation adapters and actuators."""
