"""Link F as both sides speak it (docs/protocol.md): the frames and typed messages
(``wire``), the idempotency pieces (command tables, retry buffers, lease clocks, event dedup),
the HELLO check (``handshake``), the Noise transport, the redial policy, fleet tokens, the model
files a node offers its head and where a model's converted files lie on a machine
(``model_cache``), files written atomically (``atomic_files``) and the C heap's controls
(``heap``), which the node's engine and the head's workers share.

Owns what a node and a head must agree on byte for byte.  May import nothing of sfnode; never
imports torch, never touches the reactor except through a factory it is given (``noise``).
"""
