"""ioaware models: model configurations and a small real LLM on the ioaware kernels (not yet implemented; this
package is installed so that the layout of the design is in place)."""
