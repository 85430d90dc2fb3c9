"""Data-plane routes: OpenAI's paths, and the seed design's /api/v1 aliases."""

from __future__ import annotations

from django.urls import path

from serving.batches import file_views
from serving.batches import views as batch_views
from serving.gateway import usage_views as key_usage_views
from serving.llm import seed_views
from serving.llm import views as openai_views
from serving.predict import views as predict_views
from serving.semcache import views as cache_views

app_name = "dataplane"

urlpatterns = [
    path("v1/models", openai_views.models_list, name="models"),
    path("v1/models/<str:model>", openai_views.model_detail, name="model"),
    path("v1/chat/completions", openai_views.chat_completions, name="chat-completions"),
    path("v1/completions", openai_views.completions, name="completions"),
    path("v1/embeddings", openai_views.embeddings, name="embeddings"),
    path("v1/usage", key_usage_views.usage, name="usage"),
    path("v1/cache/feedback", cache_views.cache_feedback, name="cache-feedback"),
    path("v1/files", file_views.files_root, name="files"),
    path("v1/files/<str:file_id>", file_views.file_detail, name="file"),
    path("v1/files/<str:file_id>/content", file_views.file_content, name="file-content"),
    path("v1/batches", batch_views.batches_root, name="batches"),
    path("v1/batches/<str:batch_id>", batch_views.batch_detail, name="batch"),
    path("v1/batches/<str:batch_id>/cancel", batch_views.batch_cancel, name="batch-cancel"),
    path("api/v1/chat/completions", openai_views.chat_completions, name="api-chat-completions"),
    path("api/v1/completions", openai_views.completions, name="api-completions"),
    path("api/v1/embeddings", openai_views.embeddings, name="api-embeddings"),
    path("api/v1/usage", key_usage_views.usage, name="api-usage"),
    # Small models: the Open Inference Protocol (v2) and the seeds' predict shapes.
    path("v2", predict_views.server_metadata, name="v2-server"),
    path("v2/health/live", predict_views.server_live, name="v2-live"),
    path("v2/health/ready", predict_views.server_ready, name="v2-ready"),
    path("v2/models/<str:model>", predict_views.model_metadata, name="v2-model"),
    path("v2/models/<str:model>/ready", predict_views.model_ready, name="v2-model-ready"),
    path("v2/models/<str:model>/infer", predict_views.model_infer, name="v2-infer"),
    path("v2/models/<str:model>/versions/<str:version>", predict_views.model_metadata, name="v2-version"),
    path("v2/models/<str:model>/versions/<str:version>/ready", predict_views.model_ready, name="v2-version-ready"),
    path("v2/models/<str:model>/versions/<str:version>/infer", predict_views.model_infer, name="v2-version-infer"),
    path("api/v1/predict", predict_views.predict, name="api-predict"),
    path("api/v1/models/<str:model>/predict", predict_views.model_predict, name="api-model-predict"),
    # The seeds' generate and embed shapes over the OpenAI paths.
    path("api/v1/generate", seed_views.generate, name="api-generate"),
    path("api/v1/models/<str:model>/generate", seed_views.model_generate, name="api-model-generate"),
    path("api/v1/embed", seed_views.embed, name="api-embed"),
    path("api/v1/batch", batch_views.seed_batch, name="api-batch"),
    path("api/v1/batch/<str:batch_id>", batch_views.seed_batch_detail, name="api-batch-detail"),
]
