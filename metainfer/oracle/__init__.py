"""The accuracy oracle (`metainfer verify`): the engine against transformers' reference on the same
weights. Entry points: `build.build_setup`, `verify.run_verify`, `compare.GATES`; see README.md."""
