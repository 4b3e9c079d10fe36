"""The Fast-dLLM v2 studio (Gradio): chat with a live denoising view, replay, heatmap, race and sweep."""
