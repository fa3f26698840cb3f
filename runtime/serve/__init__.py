"""The board service: ``boardtalk serve`` (voice loop, HTTP API, Wyoming) under systemd."""
