"""The node programs: prefill node, decode node (the front door), and the client."""
