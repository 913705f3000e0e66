"""What tritonserver's Python backend needs, without importing tritonserver.

- `triton_io`: request tensors -> prompt + SamplingParams; engine outputs -> response tensors.
- `adapter`: `TritonAdapter`, the loop behind model_repository/dsv4/1/model.py (pb_utils passed in).
- `metrics`: Prometheus metrics through Triton's custom-metrics API.
"""
