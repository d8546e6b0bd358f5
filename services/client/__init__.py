"""Python client of Conveyor's public Generation API (sync and asyncio)."""

from services.client.client import AsyncConveyorClient, ConveyorClient, Delta, Result

__all__ = ["AsyncConveyorClient", "ConveyorClient", "Delta", "Result"]
