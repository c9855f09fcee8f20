"""The admin UI under /ui/."""

from __future__ import annotations

from django.urls import path

from frontend import money, upstreams, views

urlpatterns = [
    path("", views.home),
    path("login", views.login_view),
    path("logout", views.logout_view),
    path("dashboard", views.dashboard),
    path("live/stream", views.dashboard_stream),
    path("tenants", views.tenants),
    path("tenants/new", views.tenant_new),
    path("tenants/<int:tenant_id>/tool-policy", views.tool_policy_edit),
    path("tool-policy", views.tool_policy_edit),
    path("deployments", views.deployments),
    path("deployments/<str:name>", views.deployment),
    path("deployments/<str:name>/breaker", views.breaker),
    path("upstreams", upstreams.upstream_list),
    path("upstreams/new", upstreams.upstream_new),
    path("upstreams/<str:name>", upstreams.upstream_edit),
    path("aliases", upstreams.alias_list),
    path("aliases/new", upstreams.alias_new),
    path("aliases/<path:name>/edit", upstreams.alias_edit),
    path("quotas", views.quotas),
    path("quotas/new", views.quota_new),
    path("quotas/<int:quota_id>", views.quota_edit),
    path("limits", views.limits),
    path("limits/new", views.limit_new),
    path("limits/<int:policy_id>", views.limit_edit),
    path("members", views.members),
    path("members/new", views.member_new),
    path("members/<int:member_id>", views.member_edit),
    path("keys", views.keys),
    path("keys/new", views.key_new),
    path("keys/<int:key_id>/revoke", views.key_revoke),
    path("usage", views.usage),
    path("spend", money.spend),
    path("spend.csv", money.spend_csv),
    path("budgets", money.budgets),
    path("budgets/new", money.budget_new),
    path("budgets/<int:budget_id>", money.budget_edit),
    path("conversations", views.conversations),
    path("audit", views.audit),
    path("audit/verify", views.audit_verify),
    path("audit/exports/new", views.export_new),
    path("audit/exports/<int:export_id>", views.export_status),
    path("audit/exports/<int:export_id>/download", views.export_download),
    path("audit/<int:event_id>", views.audit_event),
    path("static/<str:name>", views.static_file),
]
