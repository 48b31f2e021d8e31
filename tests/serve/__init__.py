"""The outer rooms: the OpenAI-compatible server, the command line, Ray replicas."""
