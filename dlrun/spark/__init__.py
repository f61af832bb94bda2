"""The Spark backend: a barrier stage whose tasks run dlrun's host agent and connect back to
the driver. The only pyspark importer.
"""
