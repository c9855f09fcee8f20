
import django.db.models.deletion
import django.utils.timezone
import governance.models
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('governance', '0005_money'),
        ('tenants', '0006_tenant_time_zone'),
    ]

    operations = [
        migrations.AddField(
            model_name='budget',
            name='alert_at',
            field=models.JSONField(blank=True, default=governance.models.default_alert_at),
        ),
        migrations.AddField(
            model_name='budget',
            name='fallback_model',
            field=models.CharField(blank=True, default='', max_length=100),
        ),
        migrations.AlterField(
            model_name='budget',
            name='window',
            field=models.CharField(choices=[('day', "Calendar day (the tenant's time zone)"), ('week', "Calendar week from Monday (the tenant's time zone)"), ('month', "Calendar month (the tenant's time zone)"), ('total', 'Never resets')], default='month', max_length=8),
        ),
        migrations.CreateModel(
            name='AlertWebhook',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('url', models.CharField(max_length=2048)),
                ('secret_sealed', models.TextField()),
                ('secret_hint', models.CharField(blank=True, default='', max_length=8)),
                ('updated_at', models.DateTimeField(default=django.utils.timezone.now)),
                ('tenant', models.OneToOneField(on_delete=django.db.models.deletion.CASCADE, related_name='alert_webhook', to='tenants.tenant')),
            ],
        ),
    ]
