"""How a process runs: distributed setup, stop/failure handling and fault injection, waits that
say what they wait for, progress lines, library noise, library workarounds."""
