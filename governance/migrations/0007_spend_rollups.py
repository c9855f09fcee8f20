
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('governance', '0006_budget_alerts'),
        ('tenants', '0006_tenant_time_zone'),
    ]

    operations = [
        migrations.CreateModel(
            name='UsageDay',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('start', models.DateTimeField()),
                ('member_id', models.BigIntegerField(blank=True, null=True)),
                ('key_prefix', models.CharField(blank=True, default='', max_length=16)),
                ('model', models.CharField(blank=True, default='', max_length=100)),
                ('calls', models.BigIntegerField(default=0)),
                ('errors', models.BigIntegerField(default=0)),
                ('prompt_tokens', models.BigIntegerField(default=0)),
                ('completion_tokens', models.BigIntegerField(default=0)),
                ('cached_tokens', models.BigIntegerField(default=0)),
                ('cost_nanousd', models.BigIntegerField(default=0)),
                ('latency_hist', models.JSONField(default=dict)),
                ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tenants.tenant')),
            ],
            options={
                'indexes': [models.Index(fields=['tenant', 'start'], name='governance__tenant__f017a1_idx')],
            },
        ),
        migrations.CreateModel(
            name='UsageHour',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('start', models.DateTimeField()),
                ('member_id', models.BigIntegerField(blank=True, null=True)),
                ('key_prefix', models.CharField(blank=True, default='', max_length=16)),
                ('model', models.CharField(blank=True, default='', max_length=100)),
                ('calls', models.BigIntegerField(default=0)),
                ('errors', models.BigIntegerField(default=0)),
                ('prompt_tokens', models.BigIntegerField(default=0)),
                ('completion_tokens', models.BigIntegerField(default=0)),
                ('cached_tokens', models.BigIntegerField(default=0)),
                ('cost_nanousd', models.BigIntegerField(default=0)),
                ('latency_hist', models.JSONField(default=dict)),
                ('tenant', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='tenants.tenant')),
            ],
            options={
                'indexes': [models.Index(fields=['tenant', 'start'], name='governance__tenant__e804ba_idx'), models.Index(fields=['start'], name='governance__start_5c92e4_idx')],
            },
        ),
    ]
