"""Engine adapters (import path ``pof_connector.adapters``): thin translations between an
engine's KV layout and calls and the engine-agnostic pool. Each module imports its engine, so
import only the one you use."""
